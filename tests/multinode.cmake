# Two namespace "hosts" joined by a veth pair (tests/multinode/bed.sh, docs/cluster.md):
# mpirun across them. Skipped (77) without root or `ip netns` rights; the watchdog and
# launch cases also until those features are in the build.
set(multinode_dir ${CMAKE_CURRENT_SOURCE_DIR}/multinode)
set(multinode_inputs ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
add_test(NAME multinode.dp2pp2_two_hosts
         COMMAND bash ${multinode_dir}/dp2pp2.sh $<TARGET_FILE:meshtrain> ${multinode_inputs})
foreach(mode killed watchdog launch)
  add_test(NAME multinode.link_down_${mode}
           COMMAND bash ${multinode_dir}/link_down.sh ${mode} $<TARGET_FILE:meshtrain> ${multinode_inputs})
endforeach()
set_tests_properties(multinode.dp2pp2_two_hosts multinode.link_down_killed
                     multinode.link_down_watchdog multinode.link_down_launch
                     PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 300 PROCESSORS 4
                                SKIP_RETURN_CODE 77)
