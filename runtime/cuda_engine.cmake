# CUDA engine (docs/cuda-engine.md): built only with CUDA; engine.kind "cuda" in make_engine.
if(DUET_HAVE_CUDA)
  target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/cuda_engine.cpp)
  target_compile_definitions(duet_runtime PRIVATE DUET_HAVE_CUDA=1)
  target_link_libraries(duet_runtime PUBLIC duet_cuda_kernels)
endif()
