add_executable(bench_cpu_engine ${CMAKE_CURRENT_LIST_DIR}/bench_cpu_engine.cpp)
target_link_libraries(bench_cpu_engine PRIVATE benchmark::benchmark duet_runtime duet_warnings)
target_compile_definitions(bench_cpu_engine PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
