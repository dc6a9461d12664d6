# `meshtrain plan` end to end: the issue's "Done means" command, --json,
# --explain, --config, and bad inputs (one line on stderr, exit 1; 2 for usage).
set(plan_bin $<TARGET_FILE:meshtrain>)
add_test(NAME plan.cli COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/plan/cli_plan.sh ${plan_bin}
         ${PROJECT_SOURCE_DIR})
set_tests_properties(plan.cli PROPERTIES TIMEOUT 60)

# meshtrain_plan_case(name exit_code regex args...)
function(meshtrain_plan_case name rc regex)
  add_test(NAME plan.${name}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/run_case.sh ${rc} ${regex} -- ${plan_bin}
                   plan ${ARGN})
  set_tests_properties(plan.${name} PROPERTIES TIMEOUT 60)
endfunction()

set(seventy --model llama3-70b --seq 8192 --global-batch-tokens 16M --tokens 15T)
meshtrain_plan_case(unknown_gpu 1 "^meshtrain: plan: unknown GPU 'h300' \\(known: a100-40gb, a100-80gb, h100-sxm, h800, h200\\)$"
                    ${seventy} --gpus 1024 --gpu h300)
meshtrain_plan_case(tp_not_dividing_heads 1 "^meshtrain: plan: --tp 3 does not divide the 64 attention heads$"
                    ${seventy} --gpus 1536 --tp 3)
meshtrain_plan_case(impossible_product 1 "^meshtrain: plan: --tp 8 x --pp 4 x --dp 16 = 512 is not --gpus 1024$"
                    ${seventy} --gpus 1024 --tp 8 --pp 4 --dp 16)
meshtrain_plan_case(unknown_model 1 "^meshtrain: plan: unknown model 'llama9-1t'"
                    --model llama9-1t --gpus 8 --global-batch 8)
meshtrain_plan_case(no_gpus 1 "^meshtrain: plan: --gpus is required" ${seventy})
meshtrain_plan_case(partial_node 1 "^meshtrain: plan: --gpus 1020 is not a whole number of 8-GPU nodes$"
                    ${seventy} --gpus 1020)
meshtrain_plan_case(batch_not_sequences 1 "^meshtrain: plan: --global-batch-tokens 1000 .* not a whole number of 8192-token sequences$"
                    --model llama3-70b --seq 8192 --global-batch-tokens 1000 --gpus 8)
meshtrain_plan_case(no_batch 1 "^meshtrain: plan: --global-batch \\(sequences\\) or --global-batch-tokens is required$"
                    --model llama3-8b --gpus 8)
meshtrain_plan_case(nothing_fits 1 "^meshtrain: plan: no layout fits in 79.6 GiB of HBM"
                    --model llama3-405b --seq 8192 --global-batch 64 --gpus 8)
meshtrain_plan_case(gpt2_seq_too_long 1 "^meshtrain: plan: --seq 2048 exceeds the model's 1024 learned positions$"
                    --model gpt2-124m --seq 2048 --global-batch 8 --gpus 8)
meshtrain_plan_case(two_models 1 "^meshtrain: plan: give exactly one model"
                    --model gpt2-124m --layers 2 --gpus 8 --global-batch 8)
meshtrain_plan_case(bad_tokens 1 "^meshtrain: plan: --tokens '15Q' has an unknown suffix 'Q'"
                    --model llama3-70b --gpus 1024 --global-batch 2048 --tokens 15Q)
meshtrain_plan_case(bad_recompute 2 "^meshtrain: .*--recompute.*" ${seventy} --gpus 1024 --recompute some)
meshtrain_plan_case(deadline_missed 1 "^meshtrain: plan: no layout trains 15T tokens within 30 days"
                    ${seventy} --gpus 1024 --max-days 30)
meshtrain_plan_case(backwards_range 1 "^meshtrain: plan: --gpus range '1024..256' runs backwards$"
                    ${seventy} --gpus 1024..256)
meshtrain_plan_case(measured_too_fast 1 "^meshtrain: plan: a measured step of 0.01 s is faster than"
                    ${seventy} --gpus 1024 --tp 8 --pp 4 --zero 1 --micro-batch 1 --recompute selective --measured-step-s 0.01)

# ZeRO table 1 through the CLI, and what --zero 3 / --shard mean.
add_test(NAME plan.cli_zero COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/plan/cli_zero.sh ${plan_bin})
set_tests_properties(plan.cli_zero PROPERTIES TIMEOUT 60)
meshtrain_plan_case(cp_not_dividing 1 "^meshtrain: plan: --cp 3 does not divide --gpus 1024$"
                    ${seventy} --gpus 1024 --cp 3)
meshtrain_plan_case(bad_finetune 2 "^meshtrain: .*--finetune.*" ${seventy} --gpus 8 --finetune dora)
meshtrain_plan_case(bad_lora_rank 1 "^meshtrain: plan: --lora-rank must be >= 1, got 0$"
                    ${seventy} --gpus 8 --finetune lora --lora-rank 0)
meshtrain_plan_case(bad_ckpt_interval 1 "^meshtrain: plan: --ckpt-every-min 'soon'"
                    ${seventy} --gpus 1024 --ckpt-every-min soon)
meshtrain_plan_case(fp8_without_fp8_cores 1 "^meshtrain: plan: --fp8: the a100-80gb has no FP8 tensor cores$"
                    --model llama3-8b --seq 4096 --global-batch 64 --gpus 8 --gpu a100-80gb --fp8)
meshtrain_plan_case(ep_fold_dense 1 "^meshtrain: plan: --ep-fold needs a mixture-of-experts model$"
                    --model llama3-8b --seq 4096 --global-batch 64 --gpus 8 --ep-fold)
meshtrain_plan_case(fp8_in_fp32 1 "^meshtrain: plan: --fp8 needs --precision bf16"
                    --model llama3-8b --seq 4096 --global-batch 64 --gpus 8 --precision fp32 --fp8)
