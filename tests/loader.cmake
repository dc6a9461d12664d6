# The GPT-2 text path end to end (prepare -> train -> sample --prompt), with
# the ranks that tests/tokenizer.cmake's fixture fetches.
if(NOT TARGET meshtrain)
  return()
endif()
set(loader_ranks ${PROJECT_SOURCE_DIR}/data/gpt2.tiktoken)
if(DEFINED ENV{MESHTRAIN_GPT2_RANKS})
  set(loader_ranks $ENV{MESHTRAIN_GPT2_RANKS})
endif()
add_test(NAME data.gpt2_text_to_sample
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/data/gpt2_sample_e2e.sh $<TARGET_FILE:meshtrain>
                 ${CMAKE_CURRENT_BINARY_DIR}/gpt2_sample_e2e ${loader_ranks})
set_tests_properties(data.gpt2_text_to_sample PROPERTIES FIXTURES_REQUIRED gpt2_ranks TIMEOUT 300)
