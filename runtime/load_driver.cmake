target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/load_driver.cpp)
