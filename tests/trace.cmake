# Timeline traces (docs/trace.md) end to end: dp 2 (+ a checkpoint in the
# window), dp 2 x pp 2, tp 2, ZeRO 3 + disk offload, one process with full
# recompute; tests/trace/check_trace.py checks each run's files.
add_test(NAME trace.cli_traces
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/trace/cli_trace.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
set_tests_properties(trace.cli_traces PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 180
                     PROCESSORS 4)
meshtrain_label_tests(threads trace.cli_traces)
