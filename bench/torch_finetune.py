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
count while resident; every tensor that is not bitsandbytes' is copied off that mapping once
loaded, so it goes, and malloc_trim(0) returns the heap loading freed); and the same for the training steps alone ("train_peak_delta_mib":
the high-water mark reset (/proc/self/clear_refs 5) once the model and optimizer are built,
read from /proc/self/status VmHWM after the steps, minus the same import baseline).
tracemalloc does not see torch's allocations, so it is not used.

usage: torch_finetune.py --model HF_DIR --method full|lora|qlora [--steps 2] [--warmup 1]
       [--batch 4] [--seq 256] [--threads 2] [--rank 8] [--alpha 16] [--targets q_proj,v_proj]
prints one JSON line; a method that cannot run prints {"error": ...} instead of timings.
QLoRA also runs one step more under torch.profiler (not timed): "dequant_share" is the CPU time
of bitsandbytes' dequantize ops over that step's wall time (the profiler's overhead in both).
"""
import argparse
import ctypes
import gc
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


def own_memory(models, torch):
    """Makes the loaded models' memory their own: transformers maps the safetensors file and
    leaves unconverted tensors (and, QLoRA, the pages the quantiser read) resident in that
    mapping, so every tensor that is not bitsandbytes' is copied to anonymous memory and the
    mapping goes (meshtrain's tracker counts its own buffers, not the file it read). Then what
    loading freed goes back to the system: glibc keeps freed heap (the bf16 weights the
    quantiser read, in whichever arena a loader thread used) resident, ~0-1.4 GB more or less
    from run to run on the 500M model otherwise."""
    with torch.no_grad():
        for m in models:
            for t in list(m.parameters()) + list(m.buffers()):
                if t.__class__.__name__ not in ("Params4bit", "Int8Params"):
                    t.data = t.data.clone()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def count_params(model, out):
    """out["params"] and out["trainable"] of the model; returns its trainable parameters."""
    params = list(model.parameters())
    trainable = [q for q in params if q.requires_grad]
    out["params"] = sum(q.numel() for q in params)
    out["trainable"] = sum(q.numel() for q in trainable)
    return trainable


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
    p.add_argument("--no-profile-dequant", dest="profile_dequant", action="store_false",
                   help="qlora: skip the extra profiled step that measures the dequantisation share")
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
        own_memory([model], torch)
        model.train()
        trainable = count_params(model, out)
        if a.method == "qlora":
            # bitsandbytes' bytes per quantised weight: packed codes, the 8-bit absmax per block,
            # the nested f32 absmax, code table and offset (its double quantisation).
            n = nbytes = 0
            seen = set()  # peft's wrapper and its base_layer share one weight
            for m in model.modules():
                w = getattr(m, "weight", None)
                if w is not None and w.__class__.__name__ == "Params4bit" and id(w) not in seen:
                    seen.add(id(w))
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
        out["model_built_file_mib"] = round(rss_kib("RssFile") / 1024, 1)
        out["model_built_anon_mib"] = round(rss_kib("RssAnon") / 1024, 1)
        times, losses = [], []

        def step(i):
            x, y = data[i % len(data), :, :-1], data[i % len(data), :, 1:]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            opt.step()
            losses.append(round(loss.item(), 4))
            return time.perf_counter() - t0

        for i in range(a.steps + a.warmup):
            times.append(step(i))
        out["train_peak_delta_mib"] = round((rss_kib("VmHWM") - base_kib) / 1024, 1)
        out["end_file_mib"] = round(rss_kib("RssFile") / 1024, 1)
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, base_maxrss)
        out["peak_rss_delta_mib"] = round((peak - base_kib) / 1024, 1)
        if a.method == "qlora" and a.profile_dequant:
            # One more step, under torch.profiler (after the timed ones: its overhead is in
            # neither), for bitsandbytes' share of it: its dequantize ops (the 4-bit codes and,
            # double quantisation, the 8-bit absmax), forward (inside gemm_4bit) and backward.
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall = step(a.steps + a.warmup)
            ops = {e.key: e.cpu_time_total for e in prof.key_averages()}
            deq = sum(v for k, v in ops.items() if k.startswith("bitsandbytes::dequantize"))
            out["profiled_step_ms"] = round(wall * 1e3, 1)
            out["dequant_ms"] = round(deq / 1e3, 1)
            out["dequant_share"] = round(deq / 1e6 / wall, 4)
            calls = {e.key: e.count for e in prof.key_averages()}
            out["dequant_ops"] = {k: [round(v / 1e3, 1), calls[k]] for k, v in ops.items()
                                  if k.startswith("bitsandbytes::")}
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
    if "peak_rss_delta_mib" not in out:  # failed: the peak up to the failure
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, base_maxrss)
        out["peak_rss_delta_mib"] = round((peak - base_kib) / 1024, 1)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
