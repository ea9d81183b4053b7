# Transport and control-plane benchmarks (docs/benchmarks.md, "Transport and control plane").
add_executable(bench_transport ${CMAKE_CURRENT_LIST_DIR}/bench_transport.cpp)
target_link_libraries(bench_transport PRIVATE benchmark::benchmark duet_actors duet_runtime duet_warnings)
add_executable(bench_control_plane ${CMAKE_CURRENT_LIST_DIR}/bench_control_plane.cpp)
target_link_libraries(bench_control_plane PRIVATE benchmark::benchmark duet_actors duet_runtime duet_warnings)
