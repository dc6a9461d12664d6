# Context parallelism under mpirun: tests/cp_mpi/test_*.cpp -> test_cp_mpi at
# 2 ranks (cp 2 against one rank, recompute, packed SFT rows, resume across
# cp) and at 4 (cp 4, dp 2 x cp 2 with ZeRO-3, cp 2 x tp 2 + SP, cp 2 x pp 2).
file(GLOB cp_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/cp_mpi/test_*.cpp)
meshtrain_mpi_program(test_cp_mpi DEPS meshtrain_train
                      SOURCES ${cp_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
meshtrain_mpi_test(cp.np2 test_cp_mpi 2 TIMEOUT 300)
meshtrain_mpi_test(cp.np4 test_cp_mpi 4 TIMEOUT 400 ARGS --gtest_filter=*Composes*:*LongSequence*:*PlannerEngine*:*Resume*)
