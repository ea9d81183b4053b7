# CPU fp32 reference engine, Hugging Face checkpoints (safetensors, config.json), sampler and
# random checkpoints (docs/cpu-engine.md).
target_sources(duet_runtime PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/safetensors.cpp
  ${CMAKE_CURRENT_LIST_DIR}/hf_model.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sampler.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cpu_engine.cpp
  ${CMAKE_CURRENT_LIST_DIR}/random_checkpoint.cpp)
# Only the kernels' explicit FMAs are fused, so every code path rounds as docs/cpu-engine.md says.
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/cpu_engine.cpp PROPERTIES COMPILE_OPTIONS -ffp-contract=off)
