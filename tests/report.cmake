# meshtrain report on real runs (1 rank; dp 2 x pp 2 on 4 ranks) with the
# headless-Chromium check of report.html (skipped, 77, without chromium), and
# the trainer's console: plain lines in a file, a progress bar on a pty.
add_test(NAME report.runs
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/report/runs.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
set_tests_properties(report.runs PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 240
                     PROCESSORS 4 SKIP_RETURN_CODE 77)
add_test(NAME report.console_progress
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/report/progress.sh $<TARGET_FILE:meshtrain>
                 ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
set_tests_properties(report.console_progress PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 120)
