# The CPU engine on the SmolLM2 GGUF against llama.cpp's outputs (needs scripts/fetch-model.sh;
# DUET_SKIP_MODEL_TESTS=1 skips the tests that need the model).
duet_add_test(test_gguf_model SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gguf_model.cpp LIBS duet_runtime)
