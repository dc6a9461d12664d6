# PyTorch reference fixtures (tests/reference/) and checks that need Python.
# reference_fixtures regenerates the fixtures into <build>/fixtures with
# MESHTRAIN_PYTHON (/usr/bin/python3, Debian's python3-torch; tests/CMakeLists.txt);
# every test_parity test requires it and reads those files (MESHTRAIN_FIXTURES). Run
# test_parity by hand to use the committed fixtures in tests/reference/fixtures instead.
set(reference_dir ${PROJECT_SOURCE_DIR}/tests/reference)
set(fixtures_dir ${CMAKE_BINARY_DIR}/fixtures)

add_test(NAME reference_fixtures
         COMMAND ${MESHTRAIN_PYTHON} ${reference_dir}/generate_fixtures.py --out ${fixtures_dir}
                 --stories ${PROJECT_SOURCE_DIR}/tests/models/stories260K.bin)
set_tests_properties(reference_fixtures PROPERTIES FIXTURES_SETUP reference_fixtures TIMEOUT 120)

# The parity tests are discovered at build time, so their names are only known
# to ctest: this script runs after gtest_discover_tests' own include file and
# uses the test list it defines.
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/parity_fixture_properties.cmake
     "if(DEFINED test_parity_TESTS)\n"
     "  set_tests_properties(\${test_parity_TESTS} PROPERTIES\n"
     "    FIXTURES_REQUIRED reference_fixtures\n"
     "    ENVIRONMENT MESHTRAIN_FIXTURES=${fixtures_dir})\n"
     "endif()\n")
set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES
             ${CMAKE_CURRENT_BINARY_DIR}/parity_fixture_properties.cmake)

# The HF export's q/k permutation, checked in Hugging Face's own RoPE convention.
add_executable(hf_export_tool ${reference_dir}/hf_export_tool.cpp)
target_link_libraries(hf_export_tool PRIVATE meshtrain_ckpt meshtrain_warnings)
add_test(NAME reference_hf_export
         COMMAND ${MESHTRAIN_PYTHON} ${reference_dir}/check_hf_export.py
                 --tool $<TARGET_FILE:hf_export_tool> --work ${CMAKE_BINARY_DIR}/hf_export_check
                 ${fixtures_dir}/llama_gqa.weights.safetensors ${fixtures_dir}/gpt2.weights.safetensors)
set_tests_properties(reference_hf_export PROPERTIES FIXTURES_REQUIRED reference_fixtures TIMEOUT 120)

# Against transformers itself, in the optional venv of scripts/setup_hf_venv.sh
# (skipped without it; CI does not install it). The committed hf_tiny_* fixtures
# are checked without the venv by test_ckpt's HfTransformers tests.
set(MESHTRAIN_HF_VENV ${PROJECT_BINARY_DIR}/hf-venv CACHE PATH "venv with torch + transformers (scripts/setup_hf_venv.sh)")
set(hf_ranks ${PROJECT_SOURCE_DIR}/data/gpt2.tiktoken)
if(DEFINED ENV{MESHTRAIN_GPT2_RANKS})
  set(hf_ranks $ENV{MESHTRAIN_GPT2_RANKS})
endif()
add_test(NAME reference_hf_venv
         COMMAND bash ${reference_dir}/hf_venv_check.sh ${MESHTRAIN_HF_VENV}/bin/python
                 $<TARGET_FILE:test_ckpt> $<TARGET_FILE:meshtrain> ${CMAKE_BINARY_DIR}/hf_venv_check ${hf_ranks})
set_tests_properties(reference_hf_venv PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)

# LoRA exports of a real LoRA run against transformers + peft (same venv; skipped without it).
add_test(NAME reference_peft_venv
         COMMAND bash ${reference_dir}/peft_venv_check.sh ${MESHTRAIN_HF_VENV}/bin/python
                 $<TARGET_FILE:meshtrain> ${CMAKE_BINARY_DIR}/peft_venv_check)
set_tests_properties(reference_peft_venv PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
