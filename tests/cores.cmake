# The policy cores of runtime/ (block manager, cost model, sim engine, router, prefill, decode,
# broker) in microseconds, and the whole cluster in one thread through tests/cluster_harness.hpp.
duet_add_test(test_cores SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cores.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_background_prefill.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_background_decode.cpp LIBS duet_runtime)
