# KV handover per transfer path (docs/benchmarks.md, "KV handover"): same pool, in-process
# device copy, CUDA IPC to another process, the stream path over tcp loopback; bytes checked.
# With --gpus A,B: between two GPUs (peer copy, CUDA IPC, NCCL; "Between GPUs (issue 10)").
if(DUET_HAVE_CUDA)
  add_executable(bench_kv_handover ${CMAKE_CURRENT_LIST_DIR}/bench_kv_handover.cpp)
  find_library(XXHASH_LIBRARY_BENCH xxhash REQUIRED)
  target_link_libraries(bench_kv_handover PRIVATE duet_runtime ${XXHASH_LIBRARY_BENCH} duet_warnings)

  # The NCCL path of --gpus: nccl.h and libnccl from NCCL_HOME, the CUDA toolkit (CUDA 13 ships
  # NCCL), the system (libnccl-dev) or the nvidia-nccl Python wheel. Without them the binary is
  # built without that path (DUET_BENCH_NCCL undefined) and says so when --gpus runs.
  find_package(CUDAToolkit QUIET)
  file(GLOB duet_nccl_wheels /usr/local/lib/python3*/dist-packages/nvidia/nccl
       /usr/lib/python3*/dist-packages/nvidia/nccl /usr/local/lib/python3*/site-packages/nvidia/nccl)
  find_path(DUET_NCCL_INCLUDE_DIR nccl.h
            HINTS ENV NCCL_HOME ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT} ${duet_nccl_wheels}
            PATH_SUFFIXES include)
  find_library(DUET_NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS ENV NCCL_HOME ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT} ${duet_nccl_wheels}
               PATH_SUFFIXES lib lib64)
  if(DUET_NCCL_INCLUDE_DIR AND DUET_NCCL_LIBRARY)
    message(STATUS "bench_kv_handover: NCCL ${DUET_NCCL_LIBRARY} (${DUET_NCCL_INCLUDE_DIR}/nccl.h)")
    target_include_directories(bench_kv_handover SYSTEM PRIVATE ${DUET_NCCL_INCLUDE_DIR})
    target_link_libraries(bench_kv_handover PRIVATE ${DUET_NCCL_LIBRARY})
    target_compile_definitions(bench_kv_handover PRIVATE DUET_BENCH_NCCL=1)
  else()
    message(STATUS "bench_kv_handover: NCCL not found (nccl.h, libnccl): --gpus runs without the NCCL path")
  endif()
endif()
