# The repository stands alone: no tracked file refers to a path outside it (docs/setup.md).
add_test(NAME repo.no_outside_paths
         COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/repo/no_outside_paths.py ${PROJECT_SOURCE_DIR})
# scripts/sanitize/lsan.supp suppresses every leak through libc's vasprintf (Open MPI's, whose
# callers the fast unwinder cannot see): that holds only while the project never calls it.
add_test(NAME repo.no_asprintf
         COMMAND bash -c "! grep -rnwE 'v?asprintf' src tests bench fuzz --include=*.cpp --include=*.h --include=*.c"
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
