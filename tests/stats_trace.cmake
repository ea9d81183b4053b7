duet_add_test(test_stats_trace SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_stats_trace.cpp LIBS duet_sim)
