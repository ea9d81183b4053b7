target_sources(duet_runtime PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/block_manager.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_arena.cpp
  ${CMAKE_CURRENT_LIST_DIR}/model_shape.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sim_engine.cpp
  ${CMAKE_CURRENT_LIST_DIR}/engine_factory.cpp
  ${CMAKE_CURRENT_LIST_DIR}/router_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/prefill_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/decode_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/broker_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/compat.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_stream.cpp
  ${CMAKE_CURRENT_LIST_DIR}/step_thread.cpp
  ${CMAKE_CURRENT_LIST_DIR}/step_log.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_pool_share.cpp)
# XXH3 checksums of KV chunks (Debian: libxxhash-dev).
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY xxhash REQUIRED)
target_include_directories(duet_runtime PRIVATE ${XXHASH_INCLUDE_DIR})
target_link_libraries(duet_runtime PRIVATE ${XXHASH_LIBRARY})
