# meshtrain launch: restart policy, kill -9 and SIGTERM of ranks under the
# supervisor, clean-up of what a killed run leaves (tests/launch/*.sh, on the
# CLI tests' byte corpus).
# (Included before mpi.cmake, so its own mpirun prefix.)
set(launch_mpirun ${MPIEXEC_EXECUTABLE} --oversubscribe --allow-run-as-root ${MPIEXEC_NUMPROC_FLAG})
set(launch_dir ${CMAKE_CURRENT_SOURCE_DIR}/launch)
set(launch_work ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
foreach(t policy kill_rank preempt cleanup shrink one_run)
  add_test(NAME launch.${t}
           COMMAND bash ${launch_dir}/${t}.sh ${launch_mpirun} -- $<TARGET_FILE:meshtrain> ${launch_work})
  set_tests_properties(launch.${t} PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 180 PROCESSORS 2)
  meshtrain_label_tests(threads launch.${t})
endforeach()
# A file system without locks, simulated by an LD_PRELOAD shim (every flock fails with ENOLCK).
add_library(no_flock MODULE ${CMAKE_CURRENT_SOURCE_DIR}/support/no_flock.cpp)
add_test(NAME launch.no_locks
         COMMAND bash ${launch_dir}/no_locks.sh $<TARGET_FILE:no_flock> ${launch_mpirun} --
                 $<TARGET_FILE:meshtrain> ${launch_work})
set_tests_properties(launch.no_locks PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 120)
meshtrain_label_targets(threads meshtrain)
