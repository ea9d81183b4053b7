target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/transport.cpp ${CMAKE_CURRENT_LIST_DIR}/client.cpp)
