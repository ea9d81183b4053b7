# GGUF reader, dequantization, model config and tokenizer extraction (docs/gguf.md).
target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/gguf.cpp
                                    ${CMAKE_CURRENT_LIST_DIR}/mapped_file.cpp)
# No a*b+c -> FMA contraction in the dequantizers, so they round like ggml's reference code
# whatever -march says. (For the types supported today every product is exact and contraction
# could not change a result; docs/gguf.md has the argument. This keeps it so for new types.)
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/gguf.cpp PROPERTIES COMPILE_OPTIONS -ffp-contract=off)
