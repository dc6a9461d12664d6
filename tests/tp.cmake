# Tensor and sequence parallelism under mpirun: tests/tp/*.cpp -> test_tp at 2 and 4 ranks
# (tp 2; tp 4 and tp 2 x dp 2).
file(GLOB tp_test_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/tp/test_*.cpp)
meshtrain_mpi_program(test_tp DEPS meshtrain_ckpt meshtrain_ddp meshtrain_zero
                      SOURCES ${tp_test_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 2 4)
  meshtrain_mpi_test(tp.np${np} test_tp ${np} TIMEOUT 300)
endforeach()
