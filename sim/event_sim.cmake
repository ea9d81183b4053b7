# The discrete-event simulator, deployment specs, synthetic trace specs, the planner, the
# live-cluster replay and the `duet sim` / `duet plan` commands (docs/sim.md).
target_sources(duet_sim PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/event_sim.cpp
  ${CMAKE_CURRENT_LIST_DIR}/deployment_spec.cpp
  ${CMAKE_CURRENT_LIST_DIR}/trace_spec.cpp
  ${CMAKE_CURRENT_LIST_DIR}/planner.cpp
  ${CMAKE_CURRENT_LIST_DIR}/live_replay.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cli.cpp)
