duet_add_test(test_sim SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sim.cpp LIBS duet_sim duet_actors)
target_include_directories(test_sim PRIVATE ${PROJECT_SOURCE_DIR})
add_dependencies(test_sim duet)
set_tests_properties(test_sim PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE)
