# ZeRO under mpirun: tests/zero_mpi/*.cpp -> test_zero_mpi at 1, 2, 3 and 4 ranks
# (3: no flat parameter divides evenly).
file(GLOB zero_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/zero_mpi/test_*.cpp)
meshtrain_mpi_program(test_zero_mpi DEPS meshtrain_train
                      SOURCES ${zero_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 1 2 3 4)
  meshtrain_mpi_test(zero.np${np} test_zero_mpi ${np} TIMEOUT 300)
endforeach()

# The CLI under mpirun with ZeRO, on the CLI tests' byte corpus (tests/cli.cmake).
add_test(NAME zero.cli_train_np2
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/zero_mpi/cli_zero.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
set_tests_properties(zero.cli_train_np2 PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 120
                     PROCESSORS 2)
# ZeRO's offload read-ahead thread beside the communication thread.
meshtrain_label_tests(threads zero.np2 zero.cli_train_np2)
meshtrain_label_targets(threads test_zero_mpi)
