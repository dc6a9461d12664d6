# Pipeline parallelism under mpirun: tests/pipeline_mpi/test_*.cpp ->
# test_pipeline_mpi at 2 and 4 ranks (oversubscribed), the CLI end to end,
# and a stage that throws mid-schedule ending the whole job.
file(GLOB pipeline_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/pipeline_mpi/test_*.cpp)
meshtrain_mpi_program(test_pipeline_mpi DEPS meshtrain_train
                      SOURCES ${pipeline_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 2 4)
  meshtrain_mpi_test(pipeline.np${np} test_pipeline_mpi ${np} TIMEOUT 300)
endforeach()

meshtrain_mpi_program(pp_fault DEPS meshtrain_pipeline SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/pipeline_mpi/fault_main.cpp)
foreach(np 2 4)
  math(EXPR last "${np} - 1")
  add_test(NAME pipeline.stage_throws_aborts_job_np${np}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/ddp/expect_failure.sh 20
                   "^rank ${last}: injected failure at step 3 in forward \\(stage ${last}\\)"
                   -- ${mpi_run} ${np} $<TARGET_FILE:pp_fault>)
  set_tests_properties(pipeline.stage_throws_aborts_job_np${np} PROPERTIES TIMEOUT 60 PROCESSORS ${np})
endforeach()

# The CLI under mpirun with pipelines (2, 4 and 8 ranks: dp, tp and pp
# combinations), on the CLI tests' byte corpus (tests/cli.cmake).
add_test(NAME pipeline.cli_train_np4
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/pipeline_mpi/cli_pp.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/cli_work)
set_tests_properties(pipeline.cli_train_np4 PROPERTIES FIXTURES_REQUIRED cli_inputs TIMEOUT 180
                     PROCESSORS 4)

# dp 2 x tp 2 x pp 2 on 8 ranks (oversubscribed): the engine-level composition test only.
# And activation checkpointing's whole runs on that layout (test_recompute_trainer.cpp).
meshtrain_mpi_test(pipeline.np8_dp2_tp2_pp2 test_pipeline_mpi 8 TIMEOUT 600
                   ARGS --gtest_filter=PipelineTensorParallel.*:RecomputeTrainer.*)
