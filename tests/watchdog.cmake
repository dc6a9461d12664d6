# Hangs: a rank stopped (SIGSTOP) or killed (SIGKILL) mid-run under mpirun; the
# job ends within comm.timeout_s + 10 s with the watchdog's diagnosis, and
# `meshtrain debug hang` agrees (tests/watchdog/stall.sh). Unit tests of the
# recorder and the diagnosis: tests/watchdog/test_flight.cpp.
set(stall_sh ${CMAKE_CURRENT_SOURCE_DIR}/watchdog/stall.sh)
set(stall_work ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
# meshtrain_stall_test(mode np signal)
function(meshtrain_stall_test mode np signal)
  set(name watchdog.${signal}_${mode}_np${np})
  add_test(NAME ${name}
           COMMAND bash ${stall_sh} ${mpi_run} -- $<TARGET_FILE:meshtrain> ${stall_work} ${np} ${mode} ${signal})
  set_tests_properties(${name} PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 120 PROCESSORS ${np}
                       LABELS threads)
endfunction()
foreach(mode ddp zero3 pipeline)
  foreach(np 2 4)
    meshtrain_stall_test(${mode} ${np} stop)
  endforeach()
endforeach()
meshtrain_stall_test(moe_ep 2 stop)
meshtrain_stall_test(moe_ep 4 stop)
meshtrain_stall_test(ddp 2 kill)
meshtrain_stall_test(moe_ep 2 kill)
meshtrain_stall_test(pipeline 4 kill)
# A run without flight records: one line naming where they were looked for, io's code.
meshtrain_cli_case(debug_hang_no_records 3
                   "^meshtrain: debug hang: no flight records in .*cli_work \\(expected .*cli_work/flight/<job>/rank_<R>.json\\)$"
                   ARGS debug hang ${cli_work})
