# GGUF files as CPU-engine models: config, dequantized weights, q/k un-permutation (docs/gguf.md).
target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/gguf_model.cpp)
