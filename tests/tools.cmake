# Helpers of the GPU scripts that run anywhere: scripts/ncu_steps.py (scripts/gpu-profile.sh's
# per-kernel tables) on a real Nsight Compute CSV of the H200.
if(EXISTS /usr/bin/python3)
  add_test(NAME ncu_steps_tables
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/tools/check_ncu_steps.py ${PROJECT_SOURCE_DIR})
  set_tests_properties(ncu_steps_tables PROPERTIES TIMEOUT 60)
endif()

# scripts/fit-prefill-mix.py against the H200's prefill steps, pricing them with `duet bench engine --engine sim`.
if(EXISTS /usr/bin/python3)
  add_test(NAME fit_prefill_mix
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/tools/check_fit_prefill_mix.py ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)
  set_tests_properties(fit_prefill_mix PROPERTIES TIMEOUT 120)
endif()

# scripts/repeat-spread.py on the stored H200 serving runs: which runs it pairs, and their cells.
if(EXISTS /usr/bin/python3)
  add_test(NAME repeat_spread
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/tools/check_repeat_spread.py ${PROJECT_SOURCE_DIR})
  set_tests_properties(repeat_spread PROPERTIES TIMEOUT 60)
endif()

# The H100 serving-fidelity figures of docs/benchmarks.md, recomputed from the stored runs
# (skipped without the Azure traces in ../shared/traces).
if(EXISTS /usr/bin/python3)
  add_test(NAME h100_fidelity
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/tools/check_h100_fidelity.py ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)
  set_tests_properties(h100_fidelity PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77)
endif()
