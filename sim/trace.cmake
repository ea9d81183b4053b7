target_sources(duet_sim PRIVATE ${CMAKE_CURRENT_LIST_DIR}/trace.cpp)
