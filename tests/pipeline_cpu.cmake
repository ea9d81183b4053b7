# The CPU engine inside the PD pipeline (SmolLM2 GGUF): a live cluster, in one process and as two
# `duet node` processes over ipc, against one engine alone (needs scripts/fetch-model.sh;
# DUET_SKIP_MODEL_TESTS=1 skips it when the model is absent).
duet_add_test(test_pipeline_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_pipeline_cpu.cpp LIBS duet_actors duet_runtime)
target_include_directories(test_pipeline_cpu PRIVATE ${PROJECT_SOURCE_DIR})
add_dependencies(test_pipeline_cpu duet)
set_tests_properties(test_pipeline_cpu PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE)
