duet_add_test(test_gguf SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gguf.cpp LIBS duet_runtime)
