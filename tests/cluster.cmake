duet_add_test(test_cluster SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cluster.cpp LIBS duet_actors duet_runtime)
target_include_directories(test_cluster PRIVATE ${PROJECT_SOURCE_DIR})
add_dependencies(test_cluster duet)
set_tests_properties(test_cluster PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE)

# docs/protocol.md is enough to write a client in another language: Python proves it.
add_test(NAME python_client_streams_from_two_nodes
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/tools/check_python_client.py $<TARGET_FILE:duet>)
set_tests_properties(python_client_streams_from_two_nodes PROPERTIES TIMEOUT 120)
