# Checks of the repository's Python scripts that run anywhere: tests/tools/SCRIPT with ARGN,
# TIMEOUT seconds; a script exits 77 to say it was skipped (data it needs is not here).
function(duet_script_check name script timeout)
  if(EXISTS /usr/bin/python3)
    add_test(NAME ${name} COMMAND /usr/bin/python3 ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/tools/${script} ${ARGN})
    set_tests_properties(${name} PROPERTIES TIMEOUT ${timeout} SKIP_RETURN_CODE 77)
  endif()
endfunction()

# Helpers of the GPU scripts: scripts/ncu_steps.py (scripts/gpu-profile.sh's per-kernel tables)
# on a real Nsight Compute CSV of the H200.
duet_script_check(ncu_steps_tables check_ncu_steps.py 60 ${PROJECT_SOURCE_DIR})

# scripts/fit-prefill-mix.py against the H200's prefill steps, pricing them with `duet bench engine --engine sim`.
duet_script_check(fit_prefill_mix check_fit_prefill_mix.py 120 ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)

# scripts/repeat-spread.py on the stored H200 serving runs: which runs it pairs, and their cells.
duet_script_check(repeat_spread check_repeat_spread.py 60 ${PROJECT_SOURCE_DIR})

# The H100 serving-fidelity figures of docs/benchmarks.md, recomputed from the stored runs
# (skipped without the Azure traces in ../shared/traces).
duet_script_check(h100_fidelity check_h100_fidelity.py 600 ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)

# The same for the H200's runs of the engine without the prompt-length stall.
duet_script_check(h200_fidelity check_h200_fidelity.py 600 ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)

# scripts/compare-steps.py beside: its live cells against a plain reading of the step logs, and
# the one-row decode step's wait beside prefill as docs/sim.md gives it (skipped without traces).
duet_script_check(compare_steps_beside check_compare_steps_beside.py 300 ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)

# scripts/predict-serve.py: its rows equal predictions committed before the runs, and a deployment
# named for no trace window is refused (skipped without traces).
duet_script_check(predict_serve check_predict_serve.py 300 ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)

# scripts/scan-targets.py: its rows equal the scan committed before the loads it chose ran, with
# verdicts, and bad arguments are refused (skipped without traces).
duet_script_check(scan_targets check_scan_targets.py 300 ${PROJECT_SOURCE_DIR} $<TARGET_FILE:duet>)
