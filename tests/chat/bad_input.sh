#!/usr/bin/env bash
# Bad chat input ends with one line on stderr that names it, and a non-zero exit:
# a conversation with an unknown role, a template that raises, a template that does not parse,
# a folder without a template, and a chat-jsonl run on a bad record (file and line named).
# usage: bad_input.sh MESHTRAIN WORK_DIR VOCAB_DIR
set -euo pipefail
bin=$1 work=$2 vocab=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
folder() {  # folder NAME TEMPLATE_TEXT
  printf '%s' "$2" >"$work/$1.jinja"
  python3 "$here/make_model_folder.py" "$vocab/qwen2/tokenizer.json" "$work/$1.jinja" "$work/$1"
}
# expect EXIT PATTERN CMD...: CMD exits EXIT with exactly one stderr line matching PATTERN.
expect() {
  local want=$1 pattern=$2 rc=0
  shift 2
  "$@" >"$work/out" 2>"$work/err" || rc=$?
  [ "$rc" -eq "$want" ] || fail "$* exited $rc, not $want: $(cat "$work/err")"
  [ "$(wc -l <"$work/err")" -eq 1 ] || fail "$*: not one line on stderr: $(cat "$work/err")"
  grep -qE "$pattern" "$work/err" || fail "$*: '$(cat "$work/err")' does not match '$pattern'"
  echo "ok: $(cat "$work/err")"
}
folder plain "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"
folder strict "{% if messages[0].role != 'system' %}{{ raise_exception('a system prompt first') }}{% endif %}x"
folder broken "{% for m in %}"
mkdir -p "$work/none" && cp "$vocab/qwen2/tokenizer.json" "$work/none/"
echo '{"eos_token": "<|im_end|>"}' >"$work/none/tokenizer_config.json"
conv='[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'

expect 1 'unknown role "narrator"' sh -c "echo '[{\"role\": \"narrator\", \"content\": \"x\"}]' | \"$bin\" tokenize --tokenizer \"$work/plain\" --chat"
expect 1 "chat template .*strict.*raise_exception: a system prompt first" sh -c "echo '$conv' | \"$bin\" tokenize --tokenizer \"$work/strict\" --chat"
expect 1 "chat template .*broken.*does not parse" sh -c "echo '$conv' | \"$bin\" tokenize --tokenizer \"$work/broken\" --chat"
expect 1 "no chat template" sh -c "echo '$conv' | \"$bin\" tokenize --tokenizer \"$work/none\" --chat"
expect 1 "stdin is not JSON" sh -c "echo 'nope' | \"$bin\" tokenize --tokenizer \"$work/plain\" --chat"

printf '%s\n%s\n' "$conv" '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}' >"$work/bad.jsonl"
cat >"$work/run.toml" <<TOML
[model]
preset = "llama-tiny"
vocab_size = 151936
[train]
steps = 1
batch_size = 1
seq_len = 32
out_dir = "$work/run"
[data]
format = "chat-jsonl"
train = "$work/bad.jsonl"
tokenizer = "$work/plain"
TOML
expect 1 "bad.jsonl:2: message 1 has the unknown role \"bot\"" "$bin" train --config "$work/run.toml"
expect 1 "no chat template" "$bin" train --config "$work/run.toml" --data.tokenizer "$work/none"
printf '%s\n' "$conv" >"$work/nosystem.jsonl"
expect 1 "nosystem.jsonl:1: chat template .*raise_exception: a system prompt first" \
  "$bin" train --config "$work/run.toml" --data.tokenizer "$work/strict" --data.train "$work/nosystem.jsonl"
echo "bad_input: ok"
