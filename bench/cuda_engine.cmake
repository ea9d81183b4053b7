# CUDA engine benchmark (docs/cuda-engine.md, "Speed"): decode step time and prefill throughput
# on a checkpoint of the real shape, with floors and kernel rates. Built only with CUDA.
if(DUET_HAVE_CUDA)
  add_executable(bench_cuda_engine ${CMAKE_CURRENT_LIST_DIR}/bench_cuda_engine.cpp)
  target_link_libraries(bench_cuda_engine PRIVATE duet_runtime duet_warnings)
endif()
