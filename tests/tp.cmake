# Tensor and sequence parallelism under mpirun: tests/tp/*.cpp -> test_tp at 2 and 4 ranks
# (tp 2; tp 4 and tp 2 x dp 2).
file(GLOB tp_test_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/tp/test_*.cpp)
meshtrain_mpi_program(test_tp DEPS meshtrain_ckpt meshtrain_ddp meshtrain_zero
                      SOURCES ${tp_test_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 2 4)
  meshtrain_mpi_test(tp.np${np} test_tp ${np} TIMEOUT 300)
endforeach()

# The CLI under mpirun with tp 2 (and sequence parallel), resumes across tp and
# the HF export, on the CLI tests' byte corpus (tests/cli.cmake).
add_test(NAME tp.cli_train_np2
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/tp/cli_tp.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
# llama-tiny's 2 kv heads over tp 4: every rank stops with the same line.
add_test(NAME tp.cli_invalid_split
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/ddp/expect_failure.sh 30
                 "^rank 0: tensor parallel: model.n_kv_heads = 2 is not divisible by tp = 4"
                 "^rank 3: tensor parallel: model.n_kv_heads = 2 is not divisible by tp = 4"
                 -- ${mpi_run} 4 $<TARGET_FILE:meshtrain> train
                 --config ${CMAKE_CURRENT_BINARY_DIR}/cli_work/good.toml --parallel.tp 4)
set_tests_properties(tp.cli_train_np2 tp.cli_invalid_split PROPERTIES FIXTURES_REQUIRED cli_inputs
                     TIMEOUT 120 PROCESSORS 2)
