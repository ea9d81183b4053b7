duet_add_test(test_cpu_engine SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cpu_engine.cpp LIBS duet_runtime)
