# Tokenizer tests that need outside material: GPT-2's ranks (fetched from PyPI
# by scripts/get_gpt2_ranks.sh), the King James Bible text (scripts/kjv_text.sh)
# and PyPI's tiktoken as the reference (tests/tokenizer/tiktoken_ref.py, run by the
# project's venv: MESHTRAIN_PY_VENV, whose pip also downloads the ranks).
# The gtests in test_data skip what lacks its material; the runs below fetch
# it in fixtures first and then require it.
if(NOT TARGET test_data)
  return()
endif()

set(tok_dir ${PROJECT_BINARY_DIR}/tokenizer_tests)
set(tok_ranks ${PROJECT_SOURCE_DIR}/data/gpt2.tiktoken)
if(DEFINED ENV{MESHTRAIN_GPT2_RANKS})
  set(tok_ranks $ENV{MESHTRAIN_GPT2_RANKS})
endif()

add_test(NAME tokenizer.fetch_gpt2_ranks
         COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/get_gpt2_ranks.sh ${tok_ranks})
set_tests_properties(tokenizer.fetch_gpt2_ranks PROPERTIES FIXTURES_SETUP gpt2_ranks TIMEOUT 300
  FIXTURES_REQUIRED py_venv ENVIRONMENT "MESHTRAIN_PY_VENV=${MESHTRAIN_PY_VENV}")

add_test(NAME tokenizer.kjv_text
         COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/kjv_text.sh ${tok_dir}/kjv)
set_tests_properties(tokenizer.kjv_text PROPERTIES FIXTURES_SETUP kjv_text TIMEOUT 120)

# The gpt2 gtests again, now with the ranks guaranteed (a skip would be a failure).
add_test(NAME tokenizer.gpt2_gtests COMMAND test_data --gtest_filter=Gpt2*:Prepare.Gpt2*)
set_tests_properties(tokenizer.gpt2_gtests PROPERTIES
  FIXTURES_REQUIRED gpt2_ranks
  ENVIRONMENT "MESHTRAIN_GPT2_RANKS=${tok_ranks};MESHTRAIN_REQUIRE_GPT2_RANKS=1;MESHTRAIN_TEST_SCRATCH=${tok_dir}/scratch"
  TIMEOUT 120)

# Token ids against tiktoken: the whole KJV, the Unicode stress text, a sweep of code points.
add_test(NAME tokenizer.tiktoken_parity COMMAND test_data --gtest_filter=TiktokenParity.*)
set_tests_properties(tokenizer.tiktoken_parity PROPERTIES
  FIXTURES_REQUIRED "gpt2_ranks;kjv_text;py_venv"
  ENVIRONMENT "MESHTRAIN_GPT2_RANKS=${tok_ranks};MESHTRAIN_REQUIRE_GPT2_RANKS=1;MESHTRAIN_TIKTOKEN_PARITY=${tok_dir};MESHTRAIN_PYPI_PYTHON=${MESHTRAIN_PY_VENV}/bin/python"
  TIMEOUT 300)

# Hugging Face tokenizer.json: the committed fixtures (tests/tokenizer/vocab, real
# vocabularies; unpack.py needs only Python's standard library) against the ids
# llama.cpp recorded from the original tokenizers, then against PyPI's tokenizers
# on every code point, random UTF-8, llama.cpp's edge cases and the KJV.
add_test(NAME tokenizer.hf_vocab
         COMMAND python3 ${PROJECT_SOURCE_DIR}/tests/tokenizer/vocab/unpack.py ${tok_dir}/vocab)
set_tests_properties(tokenizer.hf_vocab PROPERTIES FIXTURES_SETUP hf_vocab TIMEOUT 120)
add_test(NAME tokenizer.hf_originals COMMAND test_data --gtest_filter=HfTokenizerOriginals.*)
set_tests_properties(tokenizer.hf_originals PROPERTIES FIXTURES_REQUIRED hf_vocab
  ENVIRONMENT "MESHTRAIN_HF_VOCAB=${tok_dir}/vocab" TIMEOUT 120)
add_test(NAME tokenizer.hf_parity COMMAND test_data --gtest_filter=HfTokenizersParity.*)
set_tests_properties(tokenizer.hf_parity PROPERTIES
  FIXTURES_REQUIRED "hf_vocab;kjv_text;py_venv"
  ENVIRONMENT "MESHTRAIN_HF_PARITY=${tok_dir};MESHTRAIN_PYPI_PYTHON=${MESHTRAIN_PY_VENV}/bin/python"
  TIMEOUT 1200)

add_test(NAME tokenizer.hf_e2e
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/data/hf_tokenizer_e2e.sh $<TARGET_FILE:meshtrain>
                 ${tok_dir}/hf_e2e ${tok_dir}/vocab)
set_tests_properties(tokenizer.hf_e2e PROPERTIES FIXTURES_REQUIRED hf_vocab TIMEOUT 300)

# Chat templates: the real templates llama.cpp ships (third_party/llama-jinja, fetched by
# scripts/get_llama_jinja.sh) rendered byte for byte as transformers renders them
# (tests/chat/expected_renders.json.xz; chat.templates_transformers re-renders them where
# the optional hf-venv exists).
set(chat_dir ${PROJECT_BINARY_DIR}/chat_tests)
add_test(NAME chat.unpack_expected
         COMMAND python3 -c "import lzma, os, sys; os.makedirs(os.path.dirname(sys.argv[2]), exist_ok=True); open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())"
                 ${PROJECT_SOURCE_DIR}/tests/chat/expected_renders.json.xz ${chat_dir}/expected_renders.json)
set_tests_properties(chat.unpack_expected PROPERTIES FIXTURES_SETUP chat_expected TIMEOUT 60)
add_test(NAME chat.templates_conformance COMMAND test_data --gtest_filter=ChatTemplateConformance.*)
set_tests_properties(chat.templates_conformance PROPERTIES FIXTURES_REQUIRED chat_expected
  ENVIRONMENT "MESHTRAIN_CHAT_EXPECTED=${chat_dir}/expected_renders.json;TZ=UTC" TIMEOUT 120)
add_test(NAME chat.templates_transformers
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/chat/transformers_check.sh ${MESHTRAIN_HF_VENV}/bin/python
                 ${PROJECT_SOURCE_DIR}/third_party/llama-jinja/models/templates ${chat_dir}/transformers)
set_tests_properties(chat.templates_transformers PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300)
# chat-jsonl SFT: ids and masks equal transformers' on a template with generation blocks, and a
# 2-rank run equals the run on transformers' pre-tokenized ids and masks.
add_test(NAME chat.sft_transformers_parity
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/chat/chat_sft_parity.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${chat_dir}/sft ${tok_dir}/vocab ${MESHTRAIN_HF_VENV}/bin/python)
set_tests_properties(chat.sft_transformers_parity PROPERTIES FIXTURES_REQUIRED hf_vocab TIMEOUT 600
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
add_test(NAME chat.bad_input
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/chat/bad_input.sh $<TARGET_FILE:meshtrain>
                 ${chat_dir}/bad_input ${tok_dir}/vocab)
set_tests_properties(chat.bad_input PROPERTIES FIXTURES_REQUIRED hf_vocab TIMEOUT 120)
# docs/finetune.md's worked example: HF folder with a real tokenizer and chat template ->
# chat-jsonl + LoRA under mpirun -> merged export -> transformers answers a chat (hf-venv).
add_test(NAME chat.worked_example
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/chat/worked_example.sh ${mpi_run} --
                 $<TARGET_FILE:meshtrain> ${chat_dir}/worked_example ${tok_dir}/vocab
                 ${MESHTRAIN_HF_VENV}/bin/python)
set_tests_properties(chat.worked_example PROPERTIES FIXTURES_REQUIRED hf_vocab TIMEOUT 600
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
