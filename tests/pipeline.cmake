# Pipeline parallelism under mpirun: tests/pipeline_mpi/test_*.cpp ->
# test_pipeline_mpi at 2 and 4 ranks (oversubscribed), the CLI end to end,
# and a stage that throws mid-schedule ending the whole job.
file(GLOB pipeline_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/pipeline_mpi/test_*.cpp)
meshtrain_mpi_program(test_pipeline_mpi DEPS meshtrain_train
                      SOURCES ${pipeline_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 2 4)
  meshtrain_mpi_test(pipeline.np${np} test_pipeline_mpi ${np} TIMEOUT 300)
endforeach()
