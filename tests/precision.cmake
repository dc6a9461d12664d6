# (Named so that it is included after mpi.cmake, which defines the helpers.)
# fp16's mesh-wide skip under mpirun: tests/fp16_mpi/test_*.cpp -> test_fp16_mpi
# at 2 ranks (dp 2, tp 2, pp 2) and 4 (dp 4, dp 2 x tp 2, dp 2 x pp 2), oversubscribed.
file(GLOB fp16_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/fp16_mpi/test_*.cpp)
meshtrain_mpi_program(test_fp16_mpi DEPS meshtrain_train
                      SOURCES ${fp16_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 2 4)
  meshtrain_mpi_test(fp16.np${np} test_fp16_mpi ${np} TIMEOUT 180)
endforeach()
