# Two namespace "hosts" joined by a veth pair (tests/multinode/bed.sh, docs/cluster.md):
# mpirun across them. Skipped (77) without root or `ip netns` rights.
set(multinode_dir ${CMAKE_CURRENT_SOURCE_DIR}/multinode)
add_test(NAME multinode.dp2pp2_two_hosts
         COMMAND bash ${multinode_dir}/dp2pp2.sh $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
set_tests_properties(multinode.dp2pp2_two_hosts PROPERTIES FIXTURES_REQUIRED cli_inputs
                     TIMEOUT 300 PROCESSORS 4 SKIP_RETURN_CODE 77)
