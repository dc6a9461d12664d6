# Mixtures of experts under mpirun: tests/moe_mpi/test_*.cpp -> test_moe_mpi at 1 and 2
# ranks (layout equality against one rank, recompute, resume), and at 4 for expert parallelism.
file(GLOB moe_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/moe_mpi/test_*.cpp)
meshtrain_mpi_program(test_moe_mpi DEPS meshtrain_train meshtrain_report
                      SOURCES ${moe_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 1 2)
  meshtrain_mpi_test(moe.np${np} test_moe_mpi ${np} TIMEOUT 300)
endforeach()
# ep 4, ep 2 x pp 2, and resuming at ep 4: the expert-parallel tests only.
meshtrain_mpi_test(moe.np4 test_moe_mpi 4 TIMEOUT 400 ARGS --gtest_filter=*ExpertParallel*)
# ep 4 x tp 2 on 8 ranks.
meshtrain_mpi_test(moe.np8 test_moe_mpi 8 TIMEOUT 300
                   ARGS --gtest_filter=*ExpertParallelWithTensorParallel*)
