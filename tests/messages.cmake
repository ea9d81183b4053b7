# The wire format: codec tests, the decoder fuzzer, and the Python client's encoding check.
duet_add_test(test_messages SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_messages.cpp LIBS duet_messages)
