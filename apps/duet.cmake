add_executable(duet ${CMAKE_CURRENT_LIST_DIR}/duet.cpp)
target_link_libraries(duet PRIVATE duet_actors duet_runtime duet_sim duet_warnings)
set_target_properties(duet PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR})
# `duet model random` copies the repository's tokenizers (tests/data/tokenizers) by default.
target_compile_definitions(duet PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
