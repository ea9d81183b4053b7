add_executable(bench_tokenizer ${CMAKE_CURRENT_LIST_DIR}/bench_tokenizer.cpp)
target_link_libraries(bench_tokenizer PRIVATE benchmark::benchmark duet_runtime duet_warnings)
target_compile_definitions(bench_tokenizer PRIVATE
  DUET_TEST_DATA="${PROJECT_SOURCE_DIR}/tests/data" DUET_BENCH_DATA="${CMAKE_CURRENT_LIST_DIR}/data")
