duet_add_test(test_tokenizer SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer.cpp LIBS duet_runtime)
