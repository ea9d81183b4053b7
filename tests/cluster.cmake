duet_add_test(test_cluster SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cluster.cpp LIBS duet_actors duet_runtime)
target_include_directories(test_cluster PRIVATE ${PROJECT_SOURCE_DIR})
add_dependencies(test_cluster duet)
set_tests_properties(test_cluster PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE)
