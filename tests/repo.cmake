# The repository stands alone: no tracked file refers to a path outside it (docs/setup.md).
add_test(NAME repo.no_outside_paths
         COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/repo/no_outside_paths.py ${PROJECT_SOURCE_DIR})
