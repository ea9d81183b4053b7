# Model/tokenizer agreement at load (runtime/vocab_check.hpp): vocab size, bos/eos ids.
target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/vocab_check.cpp)
