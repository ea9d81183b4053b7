# GPU tests of the CUDA kernels and engine (docs/cuda-engine.md). Built only with CUDA; labelled
# "gpu": they report a skip and pass when cudaGetDeviceCount finds no device (CI has none).
# cuda_e2e is the tool scripts/gpu-check.sh drives against Hugging Face transformers.
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_kernels SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_kernels.cpp
    LIBS duet_cuda_kernels LABELS gpu)
  duet_add_test(test_cuda_engine SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_engine.cpp
    LIBS duet_runtime LABELS gpu)
  add_executable(cuda_e2e ${CMAKE_CURRENT_LIST_DIR}/cuda_e2e.cpp)
  target_link_libraries(cuda_e2e PRIVATE duet_runtime duet_warnings)
endif()
