# (Named mpi_* so the glob in tests/CMakeLists.txt includes it after mpi.cmake, which defines
# meshtrain_mpi_program.)
# LoRA under mpirun: tests/lora_mpi/*.cpp -> test_lora_mpi at 1 and 2 ranks
# (single rank, DDP, tp 2 and pp 2 against the single-rank run; resume; memory).
file(GLOB lora_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/lora_mpi/test_*.cpp)
meshtrain_mpi_program(test_lora_mpi DEPS meshtrain_train
                      SOURCES ${lora_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
foreach(np 1 2)
  meshtrain_mpi_test(lora.np${np} test_lora_mpi ${np} TIMEOUT 300)
endforeach()
