target_sources(duet_runtime PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/block_manager.cpp
  ${CMAKE_CURRENT_LIST_DIR}/model_shape.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sim_engine.cpp
  ${CMAKE_CURRENT_LIST_DIR}/engine_factory.cpp
  ${CMAKE_CURRENT_LIST_DIR}/router_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/prefill_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/decode_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/broker_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/compat.cpp)
