# KV handover per transfer path (docs/benchmarks.md, "KV handover"): same pool, in-process
# device copy, CUDA IPC to another process, the stream path over tcp loopback; bytes checked.
if(DUET_HAVE_CUDA)
  add_executable(bench_kv_handover ${CMAKE_CURRENT_LIST_DIR}/bench_kv_handover.cpp)
  find_library(XXHASH_LIBRARY_BENCH xxhash REQUIRED)
  target_link_libraries(bench_kv_handover PRIVATE duet_runtime ${XXHASH_LIBRARY_BENCH} duet_warnings)
endif()
