duet_add_test(test_cpu_engine SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cpu_engine.cpp LIBS duet_runtime)
# The same engine tests on the portable kernels (the AVX2 ones are chosen wherever the CPU has them).
add_test(NAME test_cpu_engine_generic COMMAND test_cpu_engine
  "--test-case=*prefill*,*decode*,*read_blocks*,*Hugging Face*,paged attention*")
set_tests_properties(test_cpu_engine_generic PROPERTIES ENVIRONMENT DUET_CPU_KERNELS=generic)
