#!/usr/bin/env bash
# DPO vs an SFT step on the same tokens, and vs TRL (issue 28's "Measure" for DPO): LoRA (rank 8,
# alpha 16 on q_proj and v_proj) and full fine-tuning of imported Hugging Face Llamas (make_hf in
# common.sh: 100m, 500m; bf16, vocabulary 32000), bf16, one rank, train.threads 2, against two
# PyTorch + peft peers in the same run: trl's DPO step, and the same step written out plainly.
#
# Data: random printable ASCII pairs, prompt 48 bytes, chosen and rejected 60 bytes each. With
# data.tokenizer = "bytes" and sft-jsonl's template, E "User: " prompt "\n" "Assistant: " response
# E (E = eot, id 0), each conversation is 128 tokens, 61 of them in the loss (the response and its
# closing E). The bench checks it: sft-jsonl refuses a record at seq_len 126 and names its length.
# Pairs: batch x (warm-up + timed steps), one epoch, so that full fine-tuning's reference pass
# over the data at start-up (dpo.precompute_reference, not in any step time) stays short.
#
# Per case (model x method), each round runs, in this order:
#   meshtrain DPO  data.format "preference-jsonl", data.sft_pack = false: one pair a row of 256
#                  (its two conversations are two segments), batch 4 rows = 4 pairs; [dpo] beta
#                  0.1, sigmoid. Reference: LoRA, the adapters switched off in every step (a
#                  forward pass); full, precomputed once before step 1 (the defaults).
#   meshtrain SFT  the same conversations as sft-jsonl records (two per pair), data.sft_pack =
#                  true: two 128-token records fill each row of 256 as the pair does (the bench
#                  prints both runs' "data:" lines: the same rows and loss tokens), same batch.
#   trl peer       bench/torch_dpo.py in build/hf-venv on the same pairs pre-tokenized (prompt_ids
#                  = E "User: " prompt "\n" "Assistant: ", chosen_ids / rejected_ids = the
#                  response + E): trl's DPOTrainer compute_loss on 2 x 4 rows of 128, AdamW, bf16
#                  autocast, 2 threads; LoRA's reference with adapters disabled in every step (trl's
#                  peft path), full's precomputed before step 1 (trl's precompute_ref_log_probs,
#                  --precompute-ref), as meshtrain's; then its SFT step on the same rows (loss on
#                  the responses), through trl's fused LM head as its SFTTrainer does.
#   plain peer     the same with --head plain: transformers' logits and the sigmoid loss written
#                  out, no trl in the step (trl's chunked LM head is slow on the CPU: the stronger
#                  PyTorch peer).
# Tokens per step = 2 x pairs x 128 on both sides (meshtrain: batch x 256 rows; the peer: 2 x
# batch rows of 128); tokens/s = tokens x timed steps / their summed step time, after the warm-up.
# DPO / SFT = the mean timed DPO step / the mean timed SFT step, of each side. meshtrain's timed
# steps are traced (train.trace_steps; the training pass's forward and backward spans per layer and
# classifier): "outside" is a DPO step's time outside those spans, the work DPO adds to the
# training pass (the reference's forward pass unless precomputed, and the classifier forward that
# gives the policy's log-probabilities before its fused gradient pass); an SFT step has ~none.
# Memory: meshtrain's MemoryTracker peak per category (the DPO run's end record) next to the
# engine's prediction, and its process peak RSS (/usr/bin/time %M, loading included); the peers'
# peak RSS over the DPO steps less their resident set before loading (torch_finetune.py's measure;
# with loading in parentheses).
# Sides alternate within a round; the table gives medians over rounds and the median of the
# per-round ratios, and the load average before each run is listed below it (the machine is
# shared: read the ratios of quiet rounds).
#
# usage: bench/dpo.sh [options] [steps]
#   --steps N         timed steps of the 100m runs (default 3; a bare number is the same)
#   --steps-large N   timed steps of the 500m runs (default 2)
#   --warmup N        warm-up steps before them (default 1)
#   --batch B         pairs per step (default 4)
#   --models LIST     of 100m,500m (default both)
#   --methods LIST    of lora,full (default both)
#   --rounds R        rounds of (meshtrain DPO, meshtrain SFT, trl peer, plain peer) per case
#                     (default 2)
#   --no-peer         meshtrain only
#   --cache DIR       keep the generated HF / imported models in DIR and reuse them
# needs build/hf-venv (scripts/setup_hf_venv.sh: torch 2.x, transformers, peft, trl) to make the
# models and for the peers.
# KEEP=1 keeps the runs (metrics, traces, logs, peer JSON) in the printed directory.
# Time on the 2-core VM: ~22 min for the defaults with --cache warm (500m full ~ 40% of it);
# making the models adds ~1 min.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
STEPS=3 STEPS_LARGE=2 WARMUP=1 BATCH=4 MODELS=100m,500m METHODS=lora,full ROUNDS=2 PEER=1 CACHE=""
round_option() { [ "$1" = --batch ] && BATCH=$2; }
parse_round_options "$@"
hf_peer_env 2 "transformers, peft, trl"
if [ "$have_venv" != 1 ]; then
  echo "needs $VENV_PY with transformers + peft + trl (scripts/setup_hf_venv.sh)" >&2; exit 1
fi
pin_binary
models_dir=${CACHE:-$work/models}
mkdir -p "$models_dir"
lscpu | grep "Model name" >&2
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$VENV_PY" -c "import torch, transformers, peft, trl; print('peer: torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__, 'threads', torch.get_num_threads())" 2>/dev/null >&2

# make_pairs PAIRS: $work/data_PAIRS/ with pairs.jsonl (preference-jsonl), sft.jsonl (each pair's
# two conversations as two records) and peer.jsonl (the pairs as trl's token ids).
make_pairs() {
  local d=$work/data_$1
  [ -d "$d" ] && return 0
  mkdir -p "$d"
  python3 - "$d" "$1" <<'PY'
import json, random, sys
d, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
text = lambda k: "".join(chr(rng.randrange(32, 127)) for _ in range(k))
eot = [0]  # the bytes tokenizer's eot
with open(f"{d}/pairs.jsonl", "w") as pairs, open(f"{d}/sft.jsonl", "w") as sft, \
        open(f"{d}/peer.jsonl", "w") as peer:
    for _ in range(n):
        p, c, r = text(48), text(60), text(60)
        pairs.write(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n")
        for response in (c, r):
            sft.write(json.dumps({"prompt": p, "response": response}) + "\n")
        prompt_ids = eot + list(f"User: {p}\nAssistant: ".encode())
        chosen_ids, rejected_ids = list(c.encode()) + eot, list(r.encode()) + eot
        assert len(prompt_ids) + len(chosen_ids) == len(prompt_ids) + len(rejected_ids) == 128
        peer.write(json.dumps({"prompt_ids": prompt_ids, "chosen_ids": chosen_ids,
                               "rejected_ids": rejected_ids}) + "\n")
PY
}

# write_case FILE MODEL_DIR METHOD KIND(dpo|sft) STEPS DATA_DIR OUT: a run config; the timed steps
# (after WARMUP) are traced.
write_case() {
  local file=$1 model=$2 method=$3 kind=$4 steps=$5 data=$6 out=$7
  {
    printf '[train]\ninit_from = "%s"\n' "$model"
    finetune_train_keys "$WARMUP" "$steps" "$BATCH" "$out"
    printf '[data]\ntokenizer = "bytes"\n'
    if [ "$kind" = dpo ]; then
      printf 'train = "%s/pairs.jsonl"\nformat = "preference-jsonl"\nsft_pack = false\n' "$data"
      printf '[dpo]\nbeta = 0.1\nloss = "sigmoid"\nprecompute_reference = %s\n' \
        "$([ "$method" = full ] && echo true || echo false)"
    else
      printf 'train = "%s/sft.jsonl"\nformat = "sft-jsonl"\nsft_pack = true\n' "$data"
    fi
    if [ "$method" = lora ]; then printf '[lora]\nrank = 8\nalpha = 16\ntargets = ["q_proj", "v_proj"]\n'; fi
  } >"$file"
}

# check_lengths DATA_DIR MODEL_DIR: sft-jsonl at seq_len 126 refuses the first record, naming its
# length: 128 tokens (the template as the engine renders it).
check_lengths() {
  local d=$work/check
  mkdir -p "$d"
  write_case "$d/run.toml" "$2" lora sft 1 "$1" "$d/run"
  sed -i -e 's/^seq_len = 256/seq_len = 126/' -e 's/^sft_pack = true/sft_pack = false\nsft_overflow = "refuse"/' "$d/run.toml"
  local said
  said=$("$BIN" train --config "$d/run.toml" 2>&1 || true)
  if ! grep -q "record of 128 tokens is longer" <<<"$said"; then
    echo "check FAILED: a conversation is not 128 tokens:" >&2; tail -3 <<<"$said" >&2; exit 1
  fi
  echo "check: a conversation is 128 tokens (sft-jsonl refuses it at seq_len 126)" >&2
}

# run_meshtrain CASE KIND ROUND: trains, keeping metrics, trace, log and peak RSS.
run_meshtrain() {
  local c=$1 kind=$2 r=$3 d=$work/cases/$1
  printf 'meshtrain %s\t%s\t%s\n' "$kind" "$c" "$(cut -d' ' -f1 /proc/loadavg)" >>"$work/loads"
  rm -rf "$d/run_$kind"
  if ! /usr/bin/time -o "$d/${kind}_rss_$r" -f '%M' "$BIN" train --config "$d/$kind.toml" \
      >"$d/${kind}_$r.log" 2>&1; then
    echo "meshtrain $kind failed: $c (round $r), $d/${kind}_$r.log:" >&2; tail -5 "$d/${kind}_$r.log" >&2
    return 0
  fi
  cp "$d/run_$kind/metrics.jsonl" "$d/${kind}_metrics_$r.jsonl"
  cp "$d/run_$kind/trace/rank_0.json" "$d/${kind}_trace_$r.json"
  if [ "$r" = 1 ]; then grep "^data:" "$d/${kind}_$r.log" | sed "s/^/$c $kind: /" >&2; fi
}

# run_peer CASE ROUND HEAD: bench/torch_dpo.py --head HEAD (fused: trl's step; plain: the
# plain-logits step written out).
run_peer() {
  local c=$1 r=$2 head=$3 d=$work/cases/$1
  [ "$PEER" = 1 ] || return 0
  printf 'peer %s\t%s\t%s\n' "$head" "$c" "$(cut -d' ' -f1 /proc/loadavg)" >>"$work/loads"
  local args=(--model "$(cat "$d/hf")" --data "$(cat "$d/data")/peer.jsonl" --method "$(cat "$d/method")"
    --threads 2 --batch "$BATCH" --seq 128 --warmup "$WARMUP" --steps "$(cat "$d/steps")"
    --rank 8 --alpha 16 --targets "q_proj,v_proj" --beta 0.1 --loss sigmoid --head "$head")
  if [ "$(cat "$d/method")" = full ]; then args+=(--precompute-ref); fi
  "$VENV_PY" bench/torch_dpo.py "${args[@]}" >"$d/peer_${head}_$r.json" 2>"$d/peer_${head}_$r.log" || {
    echo "peer ($head) failed: $c (round $r), $d/peer_${head}_$r.log:" >&2; tail -5 "$d/peer_${head}_$r.log" >&2; }
}

mkdir -p "$work/cases"
: >"$work/cases.list"
: >"$work/loads"
checked=0
for m in ${MODELS//,/ }; do
  case $m in
    100m) steps=$STEPS ;;
    500m) steps=$STEPS_LARGE ;;
    *) echo "unknown model $m (100m, 500m)" >&2; exit 2 ;;
  esac
  make_hf "$m"
  pairs=$((BATCH * (WARMUP + steps)))
  make_pairs "$pairs"
  if [ "$checked" = 0 ]; then check_lengths "$work/data_$pairs" "$models_dir/imported_$m"; checked=1; fi
  for method in ${METHODS//,/ }; do
    case $method in lora|full) ;; *) echo "unknown method $method (lora, full)" >&2; exit 2 ;; esac
    c="$m $method" d="$work/cases/$m $method"
    mkdir -p "$d"
    for kind in dpo sft; do
      write_case "$d/$kind.toml" "$models_dir/imported_$m" "$method" "$kind" "$steps" \
        "$work/data_$pairs" "$d/run_$kind"
    done
    echo "$method" >"$d/method"; echo "$steps" >"$d/steps"; echo "$models_dir/hf_$m" >"$d/hf"
    echo "$work/data_$pairs" >"$d/data"
    echo "$c" >>"$work/cases.list"
  done
done

# Rounds outermost, so each case's runs are spread over the whole bench.
for ((r = 1; r <= ROUNDS; r++)); do
  while read -r c; do
    echo "round $r: $c" >&2
    run_meshtrain "$c" dpo "$r"
    run_meshtrain "$c" sft "$r"
    run_peer "$c" "$r" fused
    run_peer "$c" "$r" plain
  done <"$work/cases.list"
done

python3 - "$work" "$ROUNDS" "$WARMUP" "$BATCH" <<'PY'
import json, os, statistics, sys
sys.path.insert(0, "bench")
from round_report import CATEGORIES as cats, cases_and_loads, med, mib, peer_json
work, rounds, warmup, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tokens_per_step = 2 * batch * 128  # both sides: 2 conversations x pairs x 128 tokens

def meshtrain_round(d, kind, r):
    path = f"{d}/{kind}_metrics_{r}.jsonl"
    if not os.path.exists(path):
        return None
    recs = [json.loads(l) for l in open(path)]
    end = [x for x in recs if x.get("memory") == "end"][-1]
    timed = [x for x in recs if "step_ms" in x and x["step"] > warmup]
    step_ms = [x["step_ms"] for x in timed]
    # The training pass: every span inside a traced step but the step's own.
    events = json.load(open(f"{d}/{kind}_trace_{r}.json"))["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step" and e.get("name", "").startswith("step ")]
    inside = [e for e in events if e.get("ph") == "X" and e not in steps
              and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)]
    spans_ms = sum(e["dur"] for e in inside) / 1e3 / max(1, len(steps))
    return {"end": end, "step_ms": step_ms, "mean_ms": statistics.mean(step_ms),
            "tok_s": tokens_per_step * len(step_ms) / (sum(step_ms) / 1e3),
            "untraced_ms": sum(s["dur"] for s in steps) / 1e3 / max(1, len(steps)) - spans_ms,
            "rss_mib": int(open(f"{d}/{kind}_rss_{r}").read().split()[-1]) / 1024,
            "losses": [round(x["loss"], 5) for x in recs if "step_ms" in x]}

def peer_round(d, head, r):
    return peer_json(f"{d}/peer_{head}_{r}.json")

cases, loads = cases_and_loads(work)
fmt_list = lambda xs, f="{:.2f}": " ".join(f.format(x) for x in xs)
heads = {"fused": "trl", "plain": "plain"}
notes, details, speed_rows, step_rows, memory_rows = [], [], [], [], []
for c in cases:
    d = f"{work}/cases/{c}"
    dpo = [meshtrain_round(d, "dpo", r) for r in range(1, rounds + 1)]
    sft = [meshtrain_round(d, "sft", r) for r in range(1, rounds + 1)]
    m0 = next((m for m in dpo if m), None)
    if m0 is None:
        speed_rows.append(f"| {c} | meshtrain DPO failed (dpo_1.log) |" + " |" * 7)
        continue
    speed = [f"{med([m['tok_s'] for m in dpo if m]):.0f}"]
    m_over = [m["mean_ms"] / s["mean_ms"] for m, s in zip(dpo, sft) if m and s]
    steps = [f"{med(m_over):.2f} ({fmt_list(m_over)})" if m_over else "—"]
    step_ms = [f"{med([m['mean_ms'] for m in dpo if m]):.0f} ({med([m['untraced_ms'] for m in dpo if m]):.0f})",
               f"{med([s['mean_ms'] for s in sft if s]):.0f}" if any(sft) else "—"]
    rss = [f"{med([m['rss_mib'] for m in dpo if m]):.0f}"]
    peer_details = []
    for head, name in heads.items():
        ps = [peer_round(d, head, r) for r in range(1, rounds + 1)]
        ok = [p for p in ps if p and "tokens_per_s" in p]
        notes += [f"{c}: the {name} peer failed: {p['error']}" for p in ps if p and "error" in p]
        if not ok:
            speed += ["—", "—"]; steps.append("—"); step_ms.append("—"); rss.append("—")
            continue
        ratios = [m["tok_s"] / p["tokens_per_s"] for m, p in zip(dpo, ps) if m and p and "tokens_per_s" in p]
        speed += [f"{med([p['tokens_per_s'] for p in ok]):.0f}", f"**{med(ratios):.2f}** ({fmt_list(ratios)})"]
        p_over = [p["dpo_over_sft"] for p in ok if "dpo_over_sft" in p]
        steps.append(f"{med(p_over):.2f} ({fmt_list(p_over)})" if p_over else "—")
        sft_ms = [statistics.mean(p["sft_step_ms"]) for p in ok if p.get("sft_step_ms")]
        step_ms.append(f"{med([statistics.mean(p['step_ms']) for p in ok]):.0f} / "
                       + (f"{med(sft_ms):.0f}" if sft_ms else "—"))
        train_rss, with_loading = med([p["train_peak_delta_mib"] for p in ok]), med([p["peak_rss_delta_mib"] for p in ok])
        rss.append(f"{train_rss:.0f}" + (f" ({with_loading:.0f})" if abs(with_loading - train_rss) > 1 else ""))
        peer_details.append(
            f"{name} peer DPO step_ms {[p['step_ms'] for p in ok]}, SFT {[p.get('sft_step_ms') for p in ok]}, "
            f"losses {[p['loss'] for p in ok][:1]}, RSS in DPO steps {[p['train_peak_delta_mib'] for p in ok]} / "
            f"SFT steps {[p.get('sft_peak_delta_mib') for p in ok]} MiB, reference: {ok[0]['reference']}")
    speed_rows.append(f"| {c} | " + " | ".join(speed) + " | " + " | ".join(rss) + " |")
    step_rows.append(f"| {c} | " + " | ".join(steps) + " | " + " | ".join(step_ms) + " |")
    # Memory: the DPO run's tracker peaks / prediction, and the SFT run's total beside them.
    end = m0["end"]
    cells = []
    for cat in cats:
        got, want = end["bytes"][cat + "_peak"], end["predicted"][cat]
        cells.append(f"{mib(got):.1f} / {mib(want):.1f}")
        if got != want:
            notes.append(f"{c}: DPO {cat} measured {got} B, predicted {want} B ({mib(got - want):+.2f} MiB)")
    s0 = next((s for s in sft if s), None)
    total = sum(end["bytes"][k + "_peak"] for k in cats)
    sft_total = f"{mib(sum(s0['end']['bytes'][k + '_peak'] for k in cats)):.0f}" if s0 else "—"
    memory_rows.append(f"| {c} | " + " | ".join(cells) + f" | {mib(total):.0f} | {sft_total} |")
    details.append(
        f"{c}: meshtrain DPO step_ms per round {[[round(x) for x in m['step_ms']] for m in dpo if m]}, "
        f"outside the training pass ms {[round(m['untraced_ms']) for m in dpo if m]}, losses "
        f"{[m['losses'] for m in dpo if m][:1]}; SFT step_ms {[[round(x) for x in s['step_ms']] for s in sft if s]} "
        f"(outside its spans {[round(s['untraced_ms']) for s in sft if s]}); RSS DPO "
        f"{[round(m['rss_mib']) for m in dpo if m]} / SFT {[round(s['rss_mib']) for s in sft if s]} MiB; "
        + "; ".join(peer_details) + f"; load average before each run {loads.get(c, [])}")

print("| case | meshtrain DPO tok/s | trl DPO tok/s | meshtrain / trl | plain DPO tok/s | meshtrain / plain "
      "| meshtrain peak RSS | trl peak RSS | plain peak RSS |")
print("|---|---|---|---|---|---|---|---|---|")
print("\n".join(speed_rows))
print()
print(f"tokens/s: {tokens_per_step} tokens a step (2 conversations x {batch} pairs x 128 tokens, both sides) "
      "x timed steps / their summed step time; median over rounds. trl: torch_dpo.py (trl's DPOTrainer "
      "compute_loss, its fused LM head); plain: torch_dpo.py --head plain (transformers' logits, the loss "
      "written out). meshtrain / peer: median of the per-round ratios (each round's in parentheses). "
      "Peak RSS, MiB: meshtrain, /usr/bin/time's maximum resident set of the DPO run (loading included); "
      "the peers, VmHWM over the DPO steps less the resident set before loading (with loading, where "
      "different: ru_maxrss, the same difference).")
print()
print("| case | DPO / SFT step: meshtrain | trl | plain | meshtrain DPO step ms (outside the training pass) "
      "| meshtrain SFT step ms | trl DPO / SFT step ms | plain DPO / SFT step ms |")
print("|---|---|---|---|---|---|---|---|")
print("\n".join(step_rows))
print()
print("DPO / SFT step: mean timed DPO step / mean timed SFT step on the same tokens, per round (median, each "
      "round's in parentheses). Step ms: medians of the rounds' mean timed step; in parentheses, the part of "
      "meshtrain's DPO step outside the training pass's trace spans (the work before the training pass).")
print()
print("| case (DPO) | params | grads | optimizer | activations | workspace | tracked total | SFT tracked total |")
print("|---|---|---|---|---|---|---|---|")
print("\n".join(memory_rows))
print()
print("MiB, meshtrain measured (MemoryTracker peak) / predicted (train/memory_plan) per category, "
      "of the DPO run; totals: the category peaks summed, DPO and the SFT run on the same tokens.")
print()
for line in details:
    print("- " + line)
if notes:
    print()
    print("Notes:")
    for line in notes:
        print("- " + line)
PY
