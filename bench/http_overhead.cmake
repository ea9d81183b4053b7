# HTTP front end overhead vs the native ZeroMQ endpoint (docs/http.md, "Overhead").
find_package(Boost 1.74 REQUIRED)
add_executable(http_overhead ${CMAKE_CURRENT_LIST_DIR}/http_overhead.cpp)
target_link_libraries(http_overhead PRIVATE duet_actors duet_runtime duet_warnings Boost::headers)
