# OpenAI-compatible HTTP front end (docs/http.md): the API's pure parts and the Beast server.
find_package(Boost 1.74 REQUIRED)
target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/http_api.cpp ${CMAKE_CURRENT_LIST_DIR}/http_frontend.cpp)
target_link_libraries(duet_runtime PRIVATE Boost::headers)
