duet_add_test(test_chat_template SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_chat_template.cpp LIBS duet_runtime)
