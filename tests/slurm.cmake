# A one-node Slurm (munged, slurmctld, slurmd started by the test: tests/slurm/bed.sh,
# docs/cluster.md): srun --mpi=pmix and sbatch --wait equal mpirun. Skipped (77)
# without root or the Slurm packages.
add_test(NAME slurm.srun_equals_mpirun
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/slurm/srun_equals_mpirun.sh
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
set_tests_properties(slurm.srun_equals_mpirun PROPERTIES FIXTURES_REQUIRED cli_inputs
                     TIMEOUT 300 PROCESSORS 2 SKIP_RETURN_CODE 77)
