# Multi-rank tests: each program runs under mpirun with several world sizes
# (oversubscribed: the CI machine has 2 cores). A gtest main that initialises
# MPI is in tests/comm/mpi_test_main.cpp; ranks other than 0 print only their
# failures.
set(mpi_run ${MPIEXEC_EXECUTABLE} --oversubscribe --allow-run-as-root ${MPIEXEC_NUMPROC_FLAG})

# meshtrain_mpi_program(name DEPS libs... SOURCES files...)
function(meshtrain_mpi_program name)
  cmake_parse_arguments(P "" "" "DEPS;SOURCES" ${ARGN})
  add_executable(${name} ${P_SOURCES})
  target_link_libraries(${name} PRIVATE ${P_DEPS} GTest::gtest meshtrain_warnings)
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/comm)
  target_compile_definitions(${name} PRIVATE
    MESHTRAIN_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
    MESHTRAIN_BINARY_DIR="${PROJECT_BINARY_DIR}")
endfunction()

# meshtrain_mpi_test(name program ranks [TIMEOUT s] [ARGS ...])
function(meshtrain_mpi_test name program ranks)
  cmake_parse_arguments(T "" "TIMEOUT" "ARGS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_test(NAME ${name} COMMAND ${mpi_run} ${ranks} $<TARGET_FILE:${program}> ${T_ARGS})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} PROCESSORS ${ranks})
endfunction()

file(GLOB comm_test_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/comm/*.cpp)
meshtrain_mpi_program(test_comm DEPS meshtrain_comm SOURCES ${comm_test_srcs})
# Without mpirun: an MPI singleton is one rank.
add_test(NAME comm.singleton COMMAND test_comm)
set_tests_properties(comm.singleton PROPERTIES TIMEOUT 60)
meshtrain_mpi_test(comm.np2 test_comm 2)
meshtrain_mpi_test(comm.np4 test_comm 4)

if(TARGET meshtrain_ddp)
  file(GLOB ddp_test_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/ddp/test_*.cpp)
  meshtrain_mpi_program(test_ddp DEPS meshtrain_train
                        SOURCES ${ddp_test_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
  meshtrain_mpi_test(ddp.np1 test_ddp 1)
  meshtrain_mpi_test(ddp.np2 test_ddp 2)
  meshtrain_mpi_test(ddp.np4 test_ddp 4 TIMEOUT 180)
endif()
