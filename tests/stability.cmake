# (Named so that it is included after mpi.cmake, which defines the helpers.)
# The stability guard and straggler detection under mpirun:
# tests/stability_mpi/test_*.cpp -> test_stability_mpi at 2 ranks (dp 2, tp 2,
# pp 2) and 4 (dp 4, dp 2 x tp 2, dp 2 x pp 2), oversubscribed.
file(GLOB stability_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/stability_mpi/test_*.cpp)
meshtrain_mpi_program(test_stability_mpi DEPS meshtrain_train
                      SOURCES ${stability_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 2 4)
  meshtrain_mpi_test(stability.np${np} test_stability_mpi ${np} TIMEOUT 180)
endforeach()
