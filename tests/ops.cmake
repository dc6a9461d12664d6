# The backend test suite (`meshtrain ops test`, backend/ops_suite.h) on every
# backend this build has, and its refusals.
add_test(NAME ops.test_cpu COMMAND $<TARGET_FILE:meshtrain> ops test --backend cpu)
set_tests_properties(ops.test_cpu PROPERTIES TIMEOUT 120 PROCESSORS 2)
# The suite with oneDNN held to AVX-512 BF16, no AMX: the kernel choices of CPUs without AMX
# (Zen 4) run on hosts with it too, such as bf16 attention's causal-bound score GEMMs
# (attention.cpp, whole_score_rows). On a host without AMX it repeats ops.test_cpu.
add_test(NAME ops.test_cpu_no_amx COMMAND $<TARGET_FILE:meshtrain> ops test --backend cpu)
set_tests_properties(ops.test_cpu_no_amx PROPERTIES TIMEOUT 120 PROCESSORS 2
                     ENVIRONMENT DNNL_MAX_CPU_ISA=AVX512_CORE_BF16)
# The suite on the guarded backend: it reaches every tensor through copies (backend/guarded).
add_test(NAME ops.test_guarded COMMAND $<TARGET_FILE:meshtrain> ops test --backend guarded)
set_tests_properties(ops.test_guarded PROPERTIES TIMEOUT 120 PROCESSORS 2)
add_test(NAME ops.refusals COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/ops/refusals.sh $<TARGET_FILE:meshtrain>)
set_tests_properties(ops.refusals PROPERTIES TIMEOUT 60)
meshtrain_label_tests(threads ops.test_cpu ops.test_cpu_no_amx ops.test_guarded ops.refusals)
# meshtrain-ops, the backend-only executable (cli/ops_main.cpp): the same suite, and its
# refusal and usage exits (scripts/gpu_check.sh runs it on GPU machines).
add_test(NAME ops.meshtrain_ops
         COMMAND bash -c "set -e; \"$0\" ops test --op '^(swiglu|rmsnorm)_' | tail -1 | grep -qx 'ops test: all [0-9]* cases passed'; \
                 set +e; \"$0\" ops test --backend tpu 2>/dev/null; test $? -eq 1 || exit 1; \"$0\" 2>/dev/null; test $? -eq 2"
                 $<TARGET_FILE:meshtrain-ops>)
set_tests_properties(ops.meshtrain_ops PROPERTIES TIMEOUT 60)
