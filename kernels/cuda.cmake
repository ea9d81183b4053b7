# CUDA kernels (docs/cuda-engine.md): one family per .cu with its launcher header and CPU
# reference. Built only when the project found nvcc (DUET_HAVE_CUDA); sm_90 by default.
if(DUET_HAVE_CUDA)
  find_package(CUDAToolkit REQUIRED)
  add_library(duet_cuda_kernels STATIC
    ${CMAKE_CURRENT_LIST_DIR}/launch.cu
    ${CMAKE_CURRENT_LIST_DIR}/embedding.cu ${CMAKE_CURRENT_LIST_DIR}/embedding_ref.cpp
    ${CMAKE_CURRENT_LIST_DIR}/rmsnorm.cu ${CMAKE_CURRENT_LIST_DIR}/rmsnorm_ref.cpp
    ${CMAKE_CURRENT_LIST_DIR}/rope.cu ${CMAKE_CURRENT_LIST_DIR}/rope_ref.cpp
    ${CMAKE_CURRENT_LIST_DIR}/silu_mul.cu ${CMAKE_CURRENT_LIST_DIR}/silu_mul_ref.cpp
    ${CMAKE_CURRENT_LIST_DIR}/attention.cu ${CMAKE_CURRENT_LIST_DIR}/attention_ref.cpp
    ${CMAKE_CURRENT_LIST_DIR}/gemm.cu ${CMAKE_CURRENT_LIST_DIR}/gemm_ref.cpp
    ${CMAKE_CURRENT_LIST_DIR}/sampling.cu ${CMAKE_CURRENT_LIST_DIR}/sampling_ref.cpp
    ${CMAKE_CURRENT_LIST_DIR}/kv_copy.cu ${CMAKE_CURRENT_LIST_DIR}/decode_layers.cu)
  # The wgmma prefill attention needs sm_90a's arch-specific instructions, whatever the list of
  # architectures the rest is built for; it is dispatched only on compute capability 9.0.
  add_library(duet_cuda_hopper STATIC ${CMAKE_CURRENT_LIST_DIR}/attention_wgmma.cu)
  target_include_directories(duet_cuda_hopper PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(duet_cuda_hopper PUBLIC CUDA::cudart PRIVATE duet_warnings)
  target_compile_options(duet_cuda_hopper PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills>)
  set_target_properties(duet_cuda_hopper PROPERTIES CUDA_ARCHITECTURES 90a
    POSITION_INDEPENDENT_CODE ON CUDA_SEPARABLE_COMPILATION OFF CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON)
  target_include_directories(duet_cuda_kernels PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(duet_cuda_kernels PUBLIC CUDA::cudart CUDA::cublasLt duet_cuda_hopper
    PRIVATE duet_warnings)
  target_compile_options(duet_cuda_kernels PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills>)
  set_target_properties(duet_cuda_kernels PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_SEPARABLE_COMPILATION OFF
    CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_link_libraries(duet_kernels INTERFACE duet_cuda_kernels)
endif()
