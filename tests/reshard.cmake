# Distributed checkpoints under mpirun: tests/ckpt_mpi/*.cpp -> test_ckpt_mpi
# (2 ranks: dp, ZeRO 1/2/3 + disk, tp, pp; 8 ranks: dp x tp x pp).
file(GLOB ckpt_mpi_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/ckpt_mpi/test_*.cpp)
meshtrain_mpi_program(test_ckpt_mpi DEPS meshtrain_train
                      SOURCES ${ckpt_mpi_srcs} ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi_test_main.cpp)
meshtrain_mpi_test(ckpt.reshard_np2 test_ckpt_mpi 2 TIMEOUT 600)
meshtrain_mpi_test(ckpt.reshard_np8 test_ckpt_mpi 8 TIMEOUT 900)
# kill -9 of a rank during saves: latest always verifies.
add_test(NAME ckpt.kill_rank_during_save
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/ckpt_mpi/kill_during_save.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/ckpt_work)
set_tests_properties(ckpt.kill_rank_during_save PROPERTIES TIMEOUT 300 PROCESSORS 2)
# Rank 0 commits (and renames the save's directory) before rank 1 has synced it.
add_test(NAME ckpt.commit_before_sync
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/ckpt_mpi/commit_before_sync.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_BINARY_DIR}/ckpt_work)
set_tests_properties(ckpt.commit_before_sync PROPERTIES TIMEOUT 120 PROCESSORS 2)
meshtrain_label_tests(threads ckpt.commit_before_sync)
