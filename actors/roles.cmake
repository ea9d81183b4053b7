target_sources(duet_actors PRIVATE ${CMAKE_CURRENT_LIST_DIR}/roles.cpp ${CMAKE_CURRENT_LIST_DIR}/node.cpp)
