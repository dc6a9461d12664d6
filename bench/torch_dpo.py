#!/usr/bin/env python3
"""PyTorch peer of a DPO benchmark: a Hugging Face Llama directory trained with TRL's DPO loss on
the CPU (transformers + peft + trl), AdamW, bf16 autocast, timed as bench/torch_finetune.py times
its steps (warm-up steps first, then the mean over the timed steps); then, on the same rows, the
same model's SFT step for the ratio "DPO step / SFT step".

  lora  the bf16 model frozen, LoRA (--rank 8, --alpha 16 on --targets q_proj,v_proj) added by
        DPOTrainer from a peft LoraConfig (adapters in f32: peft's autocast_adapter_dtype). The
        reference is the same model with its adapters disabled (trl's peft path:
        use_adapter(model, None) around the reference forward): no second copy.
  full  every parameter trainable, the bf16 checkpoint held in f32 and computed in bf16 under
        torch.autocast (as torch_finetune.py's full). The reference is a frozen copy, by default
        trl's own (--ref-dtype policy: DPOTrainer loads --model again in the policy's dtype, f32);
        --ref-dtype bf16 passes a bf16 copy of --model as ref_model instead.
--precompute-ref: trl's precompute_ref_log_probs (meshtrain's dpo.precompute_reference): no
        reference model is kept (full) and no reference forward runs in a step; each batch's
        reference log-probabilities come from trl's compute_ref_log_probs (the policy before
        training, adapters disabled under LoRA; under bf16 autocast) once, before the first step,
        untimed, and ride in the batch as trl's ref_chosen_logps / ref_rejected_logps.

The step is trl's code: a DPOTrainer is built (DPOConfig: beta, loss_type, max_length = --seq,
pad_to_multiple_of = --seq, no gradient checkpointing, no bf16 of its own: the loop's autocast
does it) and each step calls its compute_loss on a batch from its DataCollatorForPreference:
B pairs as 2B rows [prompt + chosen ×B; prompt + rejected ×B], each truncated (keep_start) and
padded to --seq; one forward of the policy over the 2B rows with trl's fused LM head (per-token
log-probabilities, no full logits), one no-grad reference forward, trl's loss. The loop around it
is torch_finetune.py's (zero_grad, forward + loss under autocast, backward, AdamW step), not
Trainer.train(): the timing is the step alone, no data loader, logging or scheduler.
tokens/s counts both responses' rows: 2 × B × seq per step.

--head plain: the same step without trl's fused LM head, whose chunked log-probabilities (with
the entropy, mean logit and top-1 it computes for trl's metrics) are slow on the CPU: transformers'
own forward gives the logits (B × seq × vocab, bf16 under autocast), log_softmax in f32 and a
gather give each completion token's log-probability, and the loss is DPO's sigmoid loss written
out, −log σ(β ((πc − refc) − (πr − refr))) averaged over the pairs (--loss sigmoid only); the
reference from the same forward with the adapters disabled (peft's disable_adapter), trl's
reference copy, or the precomputed values. Its SFT step is transformers' causal-LM loss. The
model, rows, optimizer and autocast are the trl run's.

SFT step: the same 2B rows, the responses' tokens the targets (the completion mask, as the DPO
loss and meshtrain's sft-jsonl: prompt tokens are context only), plain causal-LM mean loss,
through the same patched model and its fused LM head (model(..., labels, fused_lm_head=True).loss,
the head trl's SFTTrainer uses too), same optimizer; run after the DPO steps. "dpo_over_sft" is the mean
timed DPO step over the mean timed SFT step.

--data: JSONL, one pair a line, either
  {"prompt": str, "chosen": str, "rejected": str}   tokenized by DPOTrainer itself with the
      tokenizer in --model (or --tokenizer DIR): trl appends EOS to each response and starts the
      completion where the tokenized prompt and prompt + response diverge; or
  {"prompt_ids": [int], "chosen_ids": [int], "rejected_ids": [int]}   pre-tokenized, trl's own
      tokenized columns (what its collator reads), for directories without a tokenizer (trl
      then gets a stand-in word-level tokenizer over the ids, used for nothing but its checks).
Pairs are taken in file order, B per step, cycling.

Memory, as torch_finetune.py: "peak_rss_delta_mib" is ru_maxrss after the run minus the resident
set once torch / transformers / peft / trl are imported; "train_peak_delta_mib" the high-water
mark over the DPO steps alone (/proc/self/clear_refs 5 once model, reference and optimizer are
built; VmHWM after the steps) minus that baseline; "sft_peak_delta_mib" the same for the SFT steps.

usage: torch_dpo.py --model HF_DIR --data PAIRS.jsonl --method lora|full [--steps 2] [--warmup 1]
       [--batch 4] [--seq 256] [--threads 2] [--rank 8] [--alpha 16] [--targets q_proj,v_proj]
       [--beta 0.1] [--loss sigmoid|ipo] [--ref-dtype policy|bf16] [--precompute-ref] [--sft-steps N]
       [--head fused|plain] [--tokenizer DIR]
prints one JSON line; a run that fails prints {"error": ...} instead of timings.
"""
import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
import traceback

from torch_finetune import count_params, own_memory, rss_kib  # bench/, this script's folder


def read_pairs(path):
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                r = json.loads(line)
                if not isinstance(r, dict):
                    raise ValueError(f"{path}:{n}: a pair is a JSON object")
                records.append(r)
    if not records:
        raise ValueError(f"{path}: no pairs")
    text = {"prompt", "chosen", "rejected"}
    ids = {"prompt_ids", "chosen_ids", "rejected_ids"}
    kind = "text" if text <= records[0].keys() else "ids" if ids <= records[0].keys() else None
    if kind is None:
        raise ValueError(f"{path}:1: neither {sorted(text)} nor {sorted(ids)}")
    for n, r in enumerate(records, 1):
        if not (text if kind == "text" else ids) <= r.keys():
            raise ValueError(f"{path}:{n}: not a {kind} record like line 1")
    return kind, records


def stand_in_tokenizer(vocab, eos_id, pad_id):
    """A word-level tokenizer whose words are the ids themselves: DPOTrainer's construction wants
    one; the pre-tokenized pairs never go through it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=str(eos_id), pad_token=str(pad_id))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--method", choices=["full", "lora"], required=True)
    p.add_argument("--tokenizer", help="tokenizer directory for text pairs (default: --model)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sft-steps", type=int, help="timed SFT steps (default: --steps; 0: no SFT)")
    p.add_argument("--batch", type=int, default=4, help="pairs per step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss", choices=["sigmoid", "ipo"], default="sigmoid")
    p.add_argument("--ref-dtype", choices=["policy", "bf16"], default="policy",
                   help="full: trl's reference copy in the policy's dtype (f32), or a bf16 copy")
    p.add_argument("--head", choices=["fused", "plain"], default="fused",
                   help="trl's step and fused LM head, or the plain-logits step written out (above)")
    p.add_argument("--precompute-ref", action="store_true",
                   help="reference log-probabilities once before the steps (trl's precompute_ref_log_probs)")
    a = p.parse_args()
    if a.head == "plain" and a.loss != "sigmoid":
        p.error("--head plain writes out the sigmoid loss only")
    sft_steps = a.steps if a.sft_steps is None else a.sft_steps
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))

    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import peft
    import datasets
    import trl
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {"side": f"torch {torch.__version__.split('+')[0]} transformers {transformers.__version__} "
                   f"peft {peft.__version__} trl {trl.__version__}",
           "method": a.method, "head": a.head, "loss_type": a.loss, "beta": a.beta, "batch_pairs": a.batch,
           "seq": a.seq, "threads": torch.get_num_threads()}
    base_kib = rss_kib("VmRSS")
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Only the JSON line goes to stdout: transformers, datasets and trl talk to stderr.
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory() as scratch:
        try:
            kind, records = read_pairs(a.data)
            out["data"] = {"pairs": len(records), "records": kind}
            model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
            if kind == "text":
                tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or a.model)
                train = datasets.Dataset.from_list(
                    [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in records])
            else:
                vocab = model.config.vocab_size
                for n, r in enumerate(records, 1):
                    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
                        if not all(isinstance(t, int) and 0 <= t < vocab for t in r[key]):
                            raise ValueError(f"{a.data}:{n}: {key} holds an id outside [0, {vocab})")
                eos = model.config.eos_token_id
                eos = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
                pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos
                tokenizer = stand_in_tokenizer(vocab, eos, pad)
                train = datasets.Dataset.from_list([{"prompt": "1", "chosen": " 1", "rejected": " 1"}])
            ref_model = None
            if a.method == "full":
                model = model.float()
                if a.ref_dtype == "bf16":
                    ref_model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
            peft_config = None
            if a.method == "lora":
                peft_config = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, bias="none",
                                              target_modules=a.targets.split(","), task_type="CAUSAL_LM")
            args = DPOConfig(
                output_dir=scratch, beta=a.beta, loss_type=[a.loss], max_length=a.seq,
                pad_to_multiple_of=a.seq, per_device_train_batch_size=a.batch, gradient_checkpointing=False,
                bf16=False, use_cpu=True, report_to="none", save_strategy="no", dataloader_num_workers=0,
                dataset_num_proc=None, learning_rate=a.lr, precompute_ref_log_probs=a.precompute_ref)
            trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=train,
                                 processing_class=tokenizer, peft_config=peft_config)
            model = trainer.model
            if kind == "text":  # trl's tokenization: prompt_ids / chosen_ids / rejected_ids
                examples = [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                            for row in trainer.train_dataset]
            else:  # as trl drops them: pairs whose prompt alone fills --seq
                examples = [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in records
                            if len(r["prompt_ids"]) < a.seq]
            out["data"]["used"] = len(examples)
            if not examples:
                raise ValueError(f"{a.data}: every prompt fills --seq {a.seq}")
            if a.precompute_ref:
                out["reference"] = ("precomputed before step 1 (trl's compute_ref_log_probs: the policy"
                                    + (" with adapters disabled)" if a.method == "lora" else ")"))
            elif a.method == "lora":
                out["reference"] = "policy with adapters disabled (trl's peft path)"
            else:
                ref = trainer.ref_model
                out["reference"] = (f"frozen copy of --model in {next(ref.parameters()).dtype} "
                                    + ("(trl's default: loaded by DPOTrainer)" if ref_model is None
                                       else "(passed as ref_model)"))
            own_memory([model] + ([trainer.ref_model] if trainer.ref_model is not None else []),
                       torch)
            model.train()
            trainable = count_params(model, out)
            if trainer.ref_model is not None:
                out["ref_params"] = sum(q.numel() for q in trainer.ref_model.parameters())
            fused = {"fused": True} if all(q.dtype in (torch.float32, torch.bfloat16) for q in trainable) else {}
            opt = torch.optim.AdamW(trainable, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused)
            n_batches = max(a.steps + a.warmup, sft_steps + a.warmup)
            batches = [trainer.data_collator([examples[(i * a.batch + j) % len(examples)] for j in range(a.batch)])
                       for i in range(n_batches)]
            assert all(b["input_ids"].shape == (2 * a.batch, a.seq) for b in batches), "rows not padded to --seq"
            if a.precompute_ref:  # what trl's precompute stores in its dataset, per batch here
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    for b in batches:
                        b["ref_chosen_logps"], b["ref_rejected_logps"] = trainer.compute_ref_log_probs(model, b)
            out["completion_tokens_first_step"] = int(batches[0]["completion_mask"].sum())
            out["model_built_delta_mib"] = round((rss_kib("VmRSS") - base_kib) / 1024, 1)

            def run(loss_of, steps, prefix, after=None):
                """warm-up + timed steps of loss_of(batch); out[prefix + ...]: times, tokens/s,
                losses and the steps' resident high-water mark."""
                nonlocal base_maxrss
                # (clear_refs resets the mark ru_maxrss reads too: keep the peak so far)
                base_maxrss = max(base_maxrss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
                with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here on
                    f.write("5")
                times, losses = [], []
                for i in range(a.warmup + steps):
                    batch = batches[i % len(batches)]
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = loss_of(batch)
                    loss.backward()
                    opt.step()
                    times.append(time.perf_counter() - t0)
                    losses.append(round(loss.item(), 5))
                    if after:
                        after()
                timed = times[a.warmup:]
                out.update({
                    prefix + "peak_delta_mib": round((rss_kib("VmHWM") - base_kib) / 1024, 1),
                    prefix + "warmup_ms": [round(t * 1e3, 1) for t in times[:a.warmup]],
                    prefix + "step_ms": [round(t * 1e3, 1) for t in timed],
                    # both responses' rows over the timed steps' total time
                    prefix + "tokens_per_s": round(2 * a.batch * a.seq * len(timed) / sum(timed), 1),
                    prefix + "loss": losses,
                })
                return sum(timed) / len(timed)

            out["rewards"] = []

            def log_rewards():  # trl's metrics of the step just run
                metrics = trainer._metrics["train"]
                out["rewards"].append({k.split("/")[1]: round(metrics[k][-1], 5) for k in (
                    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")})
                metrics.clear()

            head_kwargs = {"fused_lm_head": True} if a.head == "fused" else {}

            def completion_logps(m, batch):  # --head plain: each row's summed completion log-probs
                logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           use_cache=False).logits[:, :-1]
                logp = torch.log_softmax(logits.float(), dim=-1).gather(
                    -1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
                return (logp * batch["completion_mask"][:, 1:]).sum(dim=1)

            def plain_dpo_loss(batch):
                if a.precompute_ref:
                    ref_c, ref_r = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
                else:
                    with torch.no_grad():
                        if trainer.ref_model is not None:
                            ref = completion_logps(trainer.ref_model, batch)
                        else:
                            with model.disable_adapter():
                                ref = completion_logps(model, batch)
                    ref_c, ref_r = ref.chunk(2)
                pol_c, pol_r = completion_logps(model, batch).chunk(2)
                return -F.logsigmoid(a.beta * ((pol_c - ref_c) - (pol_r - ref_r))).mean()

            if a.head == "fused":
                dpo_ms = run(lambda batch: trainer.compute_loss(model, batch), a.steps, "", log_rewards)
            else:
                dpo_ms = run(plain_dpo_loss, a.steps, "")
            out["train_peak_delta_mib"] = out.pop("peak_delta_mib")  # torch_finetune.py's name
            if sft_steps > 0:
                sft_ms = run(lambda batch: model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100),
                    use_cache=False, **head_kwargs).loss, sft_steps, "sft_")
                out["dpo_over_sft"] = round(dpo_ms / sft_ms, 3)
        except Exception as e:  # noqa: BLE001: the bench reports the failure and goes on
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc(limit=6)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, base_maxrss)
    out["peak_rss_delta_mib"] = round((peak - base_kib) / 1024, 1)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
