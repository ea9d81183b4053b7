# Log-probabilities end to end: a live one-process cluster of CPU engines on a tiny random
# checkpoint hands the client exactly the values the engine's sampler computed.
duet_add_test(test_logprobs SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_logprobs.cpp LIBS duet_actors duet_runtime)
target_include_directories(test_logprobs PRIVATE ${PROJECT_SOURCE_DIR})
set_tests_properties(test_logprobs PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE)
