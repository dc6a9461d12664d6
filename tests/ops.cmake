# The backend test suite (`meshtrain ops test`, backend/ops_suite.h) on every
# backend this build has, and its refusals.
add_test(NAME ops.test_cpu COMMAND $<TARGET_FILE:meshtrain> ops test --backend cpu)
set_tests_properties(ops.test_cpu PROPERTIES TIMEOUT 120 PROCESSORS 2)
add_test(NAME ops.refusals COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/ops/refusals.sh $<TARGET_FILE:meshtrain>)
set_tests_properties(ops.refusals PROPERTIES TIMEOUT 60)
meshtrain_label_tests(threads ops.test_cpu ops.refusals)
