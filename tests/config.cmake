duet_add_test(test_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_config.cpp LIBS duet_runtime)
