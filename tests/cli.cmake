# `duet model random`, `duet tokenize` (run as processes) and the model/tokenizer vocab check.
duet_add_test(test_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cli.cpp LIBS duet_runtime)
target_include_directories(test_cli PRIVATE ${PROJECT_SOURCE_DIR})
add_dependencies(test_cli duet)
set_tests_properties(test_cli PROPERTIES TIMEOUT 600)
