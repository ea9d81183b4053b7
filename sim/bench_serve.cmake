# `duet bench serve`: open-loop trace replay against a live deployment over HTTP or ZeroMQ
# (docs/benchmarks.md, "Serving benchmark").
find_package(Boost 1.74 REQUIRED)
target_sources(duet_sim PRIVATE ${CMAKE_CURRENT_LIST_DIR}/http_replay.cpp)
target_link_libraries(duet_sim PRIVATE Boost::headers)
