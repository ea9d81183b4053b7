target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/gpu_catalog.cpp)
# find_gpu_spec falls back to the source tree's config/gpus.toml when run from elsewhere.
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/gpu_catalog.cpp PROPERTIES
  COMPILE_DEFINITIONS DUET_CONFIG_DIR="${PROJECT_SOURCE_DIR}/config")
