#!/usr/bin/env python3
"""PyTorch peer of bench/finetune.sh: the same Hugging Face Llama directory fine-tuned by
transformers + peft (+ bitsandbytes for QLoRA) on the CPU, AdamW, bf16 autocast, and timed
as meshtrain times its steps (warm-up steps first, then the mean over the timed steps).

  full   every parameter trainable: the bf16 checkpoint loaded, then held in f32 (the master
         weights meshtrain keeps too) and computed in bf16 under torch.autocast (mixed precision,
         as meshtrain's precision = "bf16"); --full-dtype bf16 trains the bf16 weights themselves.
  lora   the bf16 model frozen, peft LoraConfig(r, alpha, target_modules) (peft keeps the
         adapters in f32: autocast_adapter_dtype).
  qlora  as lora on a model loaded with BitsAndBytesConfig(load_in_4bit, nf4, double quant,
         compute dtype bf16): every block linear in NF4 (lm_head stays bf16, as meshtrain's).
         No prepare_model_for_kbit_training: it would turn on gradient checkpointing and cast
         the rest to f32, neither of which meshtrain's run does.

Memory: the process's peak resident set (getrusage ru_maxrss) after the run minus its resident
set once torch / transformers / peft are imported and before the model is loaded
("peak_rss_delta_mib": loading included, and the safetensors file's pages the loader mapped
count while resident); and the same for the training steps alone ("train_peak_delta_mib":
the high-water mark reset (/proc/self/clear_refs 5) once the model and optimizer are built,
read from /proc/self/status VmHWM after the steps, minus the same import baseline).
tracemalloc does not see torch's allocations, so it is not used.

usage: torch_finetune.py --model HF_DIR --method full|lora|qlora [--steps 2] [--warmup 1]
       [--batch 4] [--seq 256] [--threads 2] [--rank 8] [--alpha 16] [--targets q_proj,v_proj]
prints one JSON line; a method that cannot run prints {"error": ...} instead of timings.
"""
import argparse
import json
import os
import resource
import sys
import time
import traceback


def rss_kib(field):  # VmRSS / VmHWM of this process, KiB
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--method", choices=["full", "lora", "qlora"], required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--full-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="full fine-tuning: f32 master weights + bf16 autocast, or bf16 weights")
    a = p.parse_args()

    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    import peft

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {"side": f"torch {torch.__version__.split('+')[0]} transformers {transformers.__version__} "
                   f"peft {peft.__version__}", "method": a.method, "threads": torch.get_num_threads()}
    base_kib = rss_kib("VmRSS")
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        kwargs = {"dtype": torch.bfloat16}
        if a.method == "qlora":
            import bitsandbytes as bnb
            out["side"] += f" bitsandbytes {bnb.__version__}"
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16)
            kwargs["device_map"] = "cpu"
        model = AutoModelForCausalLM.from_pretrained(a.model, **kwargs)
        if a.method == "full":
            if a.full_dtype == "fp32":
                model = model.float()
        else:
            from peft import LoraConfig, get_peft_model
            cfg = LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, bias="none",
                             target_modules=a.targets.split(","), task_type="CAUSAL_LM")
            model = get_peft_model(model, cfg)
        model.train()
        params = list(model.parameters())
        trainable = [q for q in params if q.requires_grad]
        out["params"] = sum(q.numel() for q in params)
        out["trainable"] = sum(q.numel() for q in trainable)
        if a.method == "qlora":
            # bitsandbytes' bytes per quantised weight: packed codes, the 8-bit absmax per block,
            # the nested f32 absmax, code table and offset (its double quantisation).
            n = nbytes = 0
            for m in model.modules():
                w = getattr(m, "weight", None)
                if w is not None and w.__class__.__name__ == "Params4bit":
                    qs = w.quant_state
                    n += qs.shape.numel()
                    nbytes += w.numel() * w.element_size() + qs.absmax.numel() * qs.absmax.element_size()
                    if qs.nested:
                        s2 = qs.state2
                        nbytes += s2.absmax.numel() * s2.absmax.element_size() + \
                            s2.code.numel() * s2.code.element_size() + 4
            out["nf4_weights"] = n
            out["nf4_bytes_per_weight"] = nbytes / n if n else None
        fused = {"fused": True} if all(q.dtype in (torch.float32, torch.bfloat16) for q in trainable) else {}
        opt = torch.optim.AdamW(trainable, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, vocab, (a.steps + a.warmup, a.batch, a.seq + 1), generator=g)
        # (clear_refs resets the mm's high-water mark that ru_maxrss reads too: keep the load's)
        base_maxrss = max(base_maxrss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here on
            f.write("5")
        out["model_built_delta_mib"] = round((rss_kib("VmRSS") - base_kib) / 1024, 1)
        times, losses = [], []
        for i in range(a.steps + a.warmup):
            x, y = data[i, :, :-1], data[i, :, 1:]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(round(loss.item(), 4))
        out["train_peak_delta_mib"] = round((rss_kib("VmHWM") - base_kib) / 1024, 1)
        timed = times[a.warmup:]
        out.update({
            "warmup_ms": [round(t * 1e3, 1) for t in times[:a.warmup]],
            "step_ms": [round(t * 1e3, 1) for t in timed],
            # tokens over the timed steps' total time (meshtrain's column: the same)
            "tokens_per_s": round(a.batch * a.seq * len(timed) / sum(timed), 1),
            "loss": losses,
        })
    except Exception as e:  # noqa: BLE001: the bench reports the failure and goes on
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=6)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, base_maxrss)
    out["peak_rss_delta_mib"] = round((peak - base_kib) / 1024, 1)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
