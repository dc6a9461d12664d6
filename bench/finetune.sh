#!/usr/bin/env bash
# Fine-tuning: full vs LoRA vs QLoRA (rank 8, alpha 16 on q_proj and v_proj; QLoRA adds
# lora.quantize_base = "nf4": every frozen block linear in NF4 with double quantisation), bf16,
# one rank, train.threads 2, seq 256, against a PyTorch peer in the same run.
#
# Models: imported Hugging Face Llamas that transformers writes (bf16, untied vocabulary 32000,
# GQA) through `ckpt import --format hf` and train.init_from:
#   100m  dim 768,  8 layers, 12/4 heads, MLP 2048  (99.7M parameters)
#   500m  dim 1536, 16 layers, 12/4 heads, MLP 4096 (501M parameters)
#   60m   the llama-60M preset (tied GPT-2 vocabulary; no HF directory, so no peer)
#
# Per case, meshtrain: the MemoryTracker's peak per category (the run's end record) next to the
# engine's prediction (train/memory_plan, what `meshtrain plan --config` prints); the GPU
# planner's params / grads / optimizer for the same method (`meshtrain plan --config RUN --gpus 1
# --finetune full|lora|qlora --lora-rank 8 --lora-targets qv`, plan/finetune.cpp); tokens/s over
# the timed steps (tokens x timed steps / their summed step_ms, after the warm-up steps); for
# QLoRA the dequantisation's share of a step: the timed steps are traced (train.trace_steps) and
# the "compute: dequantize_nf4" spans (one per NF4 GEMM weight group, forward and backward) are
# summed over the "step: step N" spans. Every meshtrain run is traced alike (a span is < 1 us).
# The peer, bench/torch_finetune.py in build/hf-venv: the same HF directory through transformers +
# peft (+ bitsandbytes NF4 double quant for QLoRA), AdamW, bf16 autocast, torch.set_num_threads
# and OMP_NUM_THREADS = 2, the same batch / seq / warm-up / timed steps; its tokens/s the same way
# and its peak resident memory over the steps (and with loading: ru_maxrss) minus the resident
# set before the model is loaded (see the script); for QLoRA one extra step under torch.profiler
# gives bitsandbytes' dequantisation share. Sides alternate (meshtrain, peer, meshtrain, peer:
# --rounds); the table gives medians over rounds and the median of the per-round ratios
# meshtrain / peer, and the load average before each run is listed below it (the machine is
# shared: read the ratios of quiet rounds).
# A second table checks NF4 bytes per base (block linear) parameter: the engine's packed bytes
# (from the tracker: QLoRA's params peak - LoRA's + 2 bytes x base GEMM weights; and nf4::layout),
# the planner's (its QLoRA - LoRA params bytes the same way; 4 + 8/64 + 32/(64*256) bits) and
# bitsandbytes' (the peer's Params4bit + quant_state bytes).
#
# usage: bench/finetune.sh [options] [steps]
#   --steps N         timed steps of the 100m / 60m runs (default 3; a bare number is the same)
#   --steps-large N   timed steps of the 500m runs (default 2)
#   --warmup N        warm-up steps before them (default 1)
#   --batch-large B   batch of the 500m runs (default 4; the others 4)
#   --models LIST     of 60m,100m,500m (default 100m,500m)
#   --methods LIST    of full,lora,qlora (default all three)
#   --rounds R        rounds of (meshtrain, peer) per case (default 2)
#   --no-peer         meshtrain only
#   --cache DIR       keep the generated HF / imported models in DIR and reuse them
# needs build/hf-venv (scripts/setup_hf_venv.sh: torch 2.x, transformers, peft, bitsandbytes)
# for the imported models and the peer; without it they are skipped (--models 60m still runs).
# KEEP=1 keeps the runs (metrics, traces, plans, peer JSON) in the printed directory.
# Time on the 2-core VM: ~17 min for the defaults (100m ~3 min; 500m full fine-tuning dominates).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
STEPS=3 STEPS_LARGE=2 WARMUP=1 BATCH_LARGE=4 MODELS=100m,500m METHODS=full,lora,qlora ROUNDS=2
PEER=1 CACHE=""
round_option() { [ "$1" = --batch-large ] && BATCH_LARGE=$2; }
parse_round_options "$@"
hf_peer_env 2 "transformers, peft"
pin_binary
models_dir=${CACHE:-$work/models}
mkdir -p "$models_dir"
lscpu | grep "Model name" >&2
[ "$have_venv" = 1 ] && "$VENV_PY" -c "import torch, transformers, peft, bitsandbytes as b; print('peer: torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bitsandbytes', b.__version__)" 2>/dev/null >&2 || true

# write_case DIR MODEL VOCAB METHOD BATCH STEPS: DIR/run.toml (MODEL: a preset name or a
# directory for train.init_from); the timed steps (after WARMUP) are traced.
write_case() {
  local d=$1 model=$2 vocab=$3 method=$4 batch=$5 steps=$6
  mkdir -p "$d"
  {
    if [ -d "$model" ]; then
      printf '[train]\ninit_from = "%s"\n' "$model"
    else
      printf '[model]\npreset = "%s"\n[train]\n' "$model"
    fi
    finetune_train_keys "$WARMUP" "$steps" "$batch" "$d/run"
    printf '[data]\ntrain = "%s"\ntokenizer = "bytes"\n' "$work/train_$vocab.bin"
    if [ "$method" != full ]; then printf '[lora]\nrank = 8\nalpha = 16\ntargets = ["q_proj", "v_proj"]\n'; fi
    if [ "$method" = qlora ]; then printf 'quantize_base = "nf4"\n'; fi
  } >"$d/run.toml"
}

# run_meshtrain CASE ROUND: trains (the round's copy of the run), keeping the metrics and trace;
# round 1 also plans the same config with the GPU planner.
run_meshtrain() {
  local c=$1 r=$2 d=$work/cases/$1
  printf 'meshtrain\t%s\t%s\n' "$c" "$(cut -d' ' -f1 /proc/loadavg)" >>"$work/loads"
  rm -rf "$d/run"
  if ! "$BIN" train --config "$d/run.toml" >"$d/train_$r.log" 2>&1; then
    echo "meshtrain failed: $c (round $r), $d/train_$r.log:" >&2; tail -5 "$d/train_$r.log" >&2
    return 0
  fi
  cp "$d/run/metrics.jsonl" "$d/metrics_$r.jsonl"
  cp "$d/run/trace/rank_0.json" "$d/trace_$r.json"
  if [ "$r" = 1 ]; then
    "$BIN" plan --config "$d/run.toml" --gpus 1 --finetune "$(cat "$d/method")" --lora-rank 8 \
      --lora-targets qv --seq 256 --global-batch "$(cat "$d/batch")" --json >"$d/plan.json"
  fi
}

run_peer() {
  local c=$1 r=$2 d=$work/cases/$1
  [ -f "$d/hf" ] || return 0
  printf 'peer\t%s\t%s\n' "$c" "$(cut -d' ' -f1 /proc/loadavg)" >>"$work/loads"
  "$VENV_PY" bench/torch_finetune.py --model "$(cat "$d/hf")" --method "$(cat "$d/method")" \
    --threads 2 --batch "$(cat "$d/batch")" --seq 256 --warmup "$WARMUP" --steps "$(cat "$d/steps")" \
    --rank 8 --alpha 16 --targets q_proj,v_proj >"$d/peer_$r.json" 2>"$d/peer_$r.log" || {
    echo "peer failed: $c (round $r), $d/peer_$r.log:" >&2; tail -5 "$d/peer_$r.log" >&2; }
}

mkdir -p "$work/cases"
: >"$work/cases.list"
: >"$work/loads"
for m in ${MODELS//,/ }; do
  case $m in
    60m) vocab=50257 model=llama-60M hf="" batch=4 steps=$STEPS ;;
    100m|500m)
      if [ "$have_venv" != 1 ]; then echo "SKIPPED $m: no $VENV_PY with transformers + peft" >&2; continue; fi
      make_hf "$m"
      if [ "$m" = 100m ]; then batch=4 steps=$STEPS; else batch=$BATCH_LARGE steps=$STEPS_LARGE; fi
      vocab=32000 model=$models_dir/imported_$m hf=$models_dir/hf_$m ;;
    *) echo "unknown model $m (60m, 100m, 500m)" >&2; exit 2 ;;
  esac
  [ -f "$work/train_$vocab.bin" ] || {
    random_tokens 40000 "$vocab" && mv "$work/train.bin" "$work/train_$vocab.bin"; }
  for method in ${METHODS//,/ }; do
    c="$m $method"
    write_case "$work/cases/$c" "$model" "$vocab" "$method" "$batch" "$steps"
    echo "$method" >"$work/cases/$c/method"; echo "$batch" >"$work/cases/$c/batch"
    echo "$steps" >"$work/cases/$c/steps"
    if [ -n "$hf" ] && [ "$PEER" = 1 ]; then echo "$hf" >"$work/cases/$c/hf"; fi
    echo "$c" >>"$work/cases.list"
  done
done

# Rounds outermost, so each case's meshtrain and peer runs are spread over the whole bench.
for ((r = 1; r <= ROUNDS; r++)); do
  while read -r c; do
    echo "round $r: $c" >&2
    run_meshtrain "$c" "$r"
    run_peer "$c" "$r"
  done <"$work/cases.list"
done

python3 - "$work" "$ROUNDS" "$WARMUP" <<'PY'
import json, os, statistics, sys
sys.path.insert(0, "bench")
from round_report import CATEGORIES as cats, cases_and_loads, med, mib, peer_json
work, rounds, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def load(path):
    return json.load(open(path)) if os.path.exists(path) else None

def meshtrain_round(d, r):
    path = f"{d}/metrics_{r}.jsonl"
    if not os.path.exists(path):
        return None
    recs = [json.loads(l) for l in open(path)]
    end = [x for x in recs if x.get("memory") == "end"][-1]
    timed = [x for x in recs if "step_ms" in x and x["step"] > warmup]
    tok_s = sum(x["loss_tokens"] for x in timed) / (sum(x["step_ms"] for x in timed) / 1e3)
    trace = json.load(open(f"{d}/trace_{r}.json"))["traceEvents"]
    steps = [e for e in trace if e.get("cat") == "step" and e.get("name", "").startswith("step ")]
    inside = lambda e: any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)
    deq = [e for e in trace if e.get("name") == "dequantize_nf4" and inside(e)]
    step_us = sum(s["dur"] for s in steps)
    return {"end": end, "tok_s": tok_s, "deq_share": sum(e["dur"] for e in deq) / step_us,
            "deq_spans": len(deq) / max(1, len(steps)), "deq_ms": sum(e["dur"] for e in deq) / 1e3 / max(1, len(steps)),
            "step_ms": [round(x["step_ms"]) for x in timed], "traced_steps": len(steps)}

def peer_round(d, r):
    return peer_json(f"{d}/peer_{r}.json")

cases, loads = cases_and_loads(work)
rows, notes, nf4 = [], [], {}
print("| case | params | grads | optimizer | activations | workspace | total | planner p / g / o "
      "| meshtrain tok/s | peer tok/s | meshtrain / peer | peer peak RSS | dequant share |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
details = []
for c in cases:
    d = f"{work}/cases/{c}"
    ms = [meshtrain_round(d, r) for r in range(1, rounds + 1)]
    ps = [peer_round(d, r) for r in range(1, rounds + 1)]
    m0 = next((m for m in ms if m), None)
    if m0 is None:
        print(f"| {c} | meshtrain failed (train_1.log) |" + " |" * 11)
        continue
    end = m0["end"]
    cells = []
    for cat in cats:
        got, want = end["bytes"][cat + "_peak"], end["predicted"][cat]
        cells.append(f"{mib(got):.1f} / {mib(want):.1f}")
        if got != want:
            notes.append(f"{c}: {cat} measured {got} B, predicted {want} B "
                         f"(measured - predicted = {got - want:+d} B, {mib(got - want):+.2f} MiB)")
    for m in ms[1:]:
        if m and any(m["end"]["bytes"][k + "_peak"] != end["bytes"][k + "_peak"] for k in cats):
            notes.append(f"{c}: the tracker's peaks differ between rounds")
    total = sum(end["bytes"][k + "_peak"] for k in cats)
    plan = load(f"{d}/plan.json")
    if plan:
        gpu = (plan["search"] if "search" in plan else plan)["ranked"][0]["memory_bytes"]
        planner = " / ".join(f"{mib(gpu[k]):.1f}" for k in ("params", "grads", "optimizer"))
    else:
        gpu, planner = None, "—"
    m_tok = med([m["tok_s"] for m in ms if m])
    ok = [p for p in ps if p and "tokens_per_s" in p]
    errs = [p for p in ps if p and "error" in p]
    p_tok = med([p["tokens_per_s"] for p in ok])
    ratios = [m["tok_s"] / p["tokens_per_s"] for m, p in zip(ms, ps) if m and p and "tokens_per_s" in p]
    if ok:
        rss = med([p["peak_rss_delta_mib"] for p in ok])
        train_rss = med([p["train_peak_delta_mib"] for p in ok])
        peer_mem = f"{train_rss:.0f} MiB" + (f" ({rss:.0f} with loading)" if abs(rss - train_rss) > 1 else "")
        peer_tok, ratio = f"{p_tok:.0f}", f"{med(ratios):.2f} ({' '.join(f'{x:.2f}' for x in ratios)})"
    elif errs:
        peer_mem = peer_tok = ratio = "error (below)"
        notes.append(f"{c}: the peer failed: {errs[0]['error']}")
    else:
        peer_mem = peer_tok = ratio = "—"
    method = c.split()[-1]
    share = "—"
    if method == "qlora":
        share = f"{med([m['deq_share'] for m in ms if m]):.1%}"
        p_share = med([p["dequant_share"] for p in ok if "dequant_share" in p])
        share += f" / {p_share:.1%}" if p_share is not None else ""
    print(f"| {c} | " + " | ".join(cells) + f" | {mib(total):.0f} | {planner} | {m_tok:.0f} | {peer_tok} "
          f"| {ratio} | {peer_mem} | {share} |")
    nf4.setdefault(c.split()[0], {})[method] = {"end": end, "gpu": gpu, "peer": ok[0] if ok else None,
                                                "toml": f"{d}/run.toml"}
    details.append(f"{c}: meshtrain step_ms per round {[m['step_ms'] for m in ms if m]}, "
                   f"tok/s {[round(m['tok_s']) for m in ms if m]}"
                   + (f", dequant {[round(m['deq_ms']) for m in ms if m]} ms/step in "
                      f"{ms[0]['deq_spans']:.0f} spans/step, share {[format(m['deq_share'], '.1%') for m in ms if m]}"
                      if method == "qlora" else "")
                   + (f"; peer step_ms {[p['step_ms'] for p in ok]}, tok/s {[p['tokens_per_s'] for p in ok]}, "
                      f"peak RSS delta {[p['peak_rss_delta_mib'] for p in ok]} MiB, in steps "
                      f"{[p['train_peak_delta_mib'] for p in ok]}, model built "
                      f"{[p['model_built_delta_mib'] for p in ok]}"
                      + (f", profiled step {[p['profiled_step_ms'] for p in ok]} ms, bitsandbytes ops "
                         f"{[p['dequant_ops'] for p in ok]} ms" if method == "qlora" and "dequant_ops" in ok[0] else "")
                      if ok else "")
                   + f"; load average before each run {loads.get(c, [])}")
print()
print("MiB, meshtrain measured (MemoryTracker peak) / predicted (train/memory_plan); total = the "
      "measured peaks summed; planner = `meshtrain plan --gpus 1 --finetune METHOD` params / grads / "
      "optimizer MiB; tok/s = tokens over the timed steps' summed step time, median over rounds; "
      "meshtrain / peer: median of the per-round ratios (each round's in parentheses); peer peak "
      "RSS: the process's peak resident set over the steps (VmHWM, reset once the model and "
      "optimizer are built) minus its resident set before loading the model (in parentheses, "
      "where different: ru_maxrss after the steps, the same difference with loading's peak); "
      "dequant share: the "
      "dequantize_nf4 trace spans over the traced (timed) steps' time / the peer's: bitsandbytes' "
      "dequantize ops (torch.profiler CPU time) over one extra profiled step.")

# NF4 bytes per base parameter: engine, planner, bitsandbytes.
def gemm_weights(toml):
    import re
    src = re.search(r'init_from = "([^"]+)"', open(toml).read())
    if not src:
        return None
    cfg = json.load(open(f"{src.group(1)}/config.json"))
    h, L, f = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]
    return L, shapes

def layout_bytes(n):  # nf4::layout(n).bytes
    blocks = n // 64
    groups = (blocks + 255) // 256
    return (groups * 4 + 4 + blocks + n // 2 + 3) // 4 * 4

print()
print("| model | base GEMM weights | engine measured B/param | engine predicted B/param | nf4::layout "
      "B/param | planner B/param | 4.127 bits / 8 | bitsandbytes B/param |")
print("|---|---|---|---|---|---|---|---|")
for model, by in nf4.items():
    if "qlora" not in by or "lora" not in by:
        continue
    q, l = by["qlora"], by["lora"]
    shape = gemm_weights(q["toml"])
    if shape is None:
        continue
    L, shapes = shape
    n = L * sum(a * b for a, b in shapes)
    layout = L * sum(layout_bytes(a * b) for a, b in shapes)
    meas = (q["end"]["bytes"]["params_peak"] - l["end"]["bytes"]["params_peak"] + 2 * n) / n
    pred = (q["end"]["predicted"]["params"] - l["end"]["predicted"]["params"] + 2 * n) / n
    plan = (q["gpu"]["params"] - l["gpu"]["params"] + 2 * n) / n if q["gpu"] and l["gpu"] else float("nan")
    bnb = q["peer"]["nf4_bytes_per_weight"] if q["peer"] and q["peer"].get("nf4_bytes_per_weight") else float("nan")
    bnb_n = q["peer"]["nf4_weights"] if q["peer"] else None
    const = (4 + 8 / 64 + 32 / (64 * 256)) / 8
    print(f"| {model} | {n} | {meas:.6f} | {pred:.6f} | {layout / n:.6f} | {plan:.6f} | {const:.6f} | {bnb:.6f} |")
    if abs(meas - pred) > 1e-9:
        notes.append(f"{model}: the engine's NF4 bytes per parameter, measured {meas:.6f} vs predicted {pred:.6f}")
    if abs(plan - const) > 1e-4:
        notes.append(f"{model}: the planner's NF4 bytes per parameter {plan:.6f} != {const:.6f}")
    if bnb_n is not None and bnb_n != n:
        notes.append(f"{model}: bitsandbytes quantised {bnb_n} weights, meshtrain {n}")
print()
print("B/param = (QLoRA params bytes - LoRA params bytes) / base GEMM weights + 2 (the bf16 bytes "
      "LoRA holds them in), from the tracker's peaks, the engine's prediction and the planner; "
      "nf4::layout sums the engine's per-tensor packed buffers; bitsandbytes: the peer's "
      "Params4bit bytes + absmax (u8) + nested absmax (f32) + code table + offset per weight.")
print()
for line in details:
    print("- " + line)
if notes:
    print()
    print("Notes:")
    for line in notes:
        print("- " + line)
PY
