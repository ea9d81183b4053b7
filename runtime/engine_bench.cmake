# `duet bench engine`: an engine's prefill and decode speed through the engine interface.
target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/engine_bench.cpp)
