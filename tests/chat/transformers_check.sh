#!/usr/bin/env bash
# The committed renders (expected_renders.json.xz) are what transformers renders today:
# re-renders every template with chat_template_ref.py and compares. Needs build/hf-venv
# (scripts/setup_hf_venv.sh); exits 77 (ctest: SKIPPED) without it.
# Usage: transformers_check.sh HF_PYTHON TEMPLATE_DIR OUT_DIR
set -euo pipefail
py=$1 templates=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
[ -x "$py" ] && "$py" -c "import transformers, jinja2" 2>/dev/null \
  || { echo "SKIPPED: no transformers venv at $py (scripts/setup_hf_venv.sh)"; exit 77; }
mkdir -p "$out"
"$py" "$here/chat_template_ref.py" render "$templates" "$here/conversations.json" "$out/renders.json"
python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' \
  "$here/expected_renders.json.xz" >"$out/committed.json"
if ! cmp -s "$out/renders.json" "$out/committed.json"; then
  echo "transformers renders differently from tests/chat/expected_renders.json.xz:" >&2
  diff "$out/committed.json" "$out/renders.json" | head -40 >&2
  exit 1
fi
echo "transformers $("$py" -c 'import transformers; print(transformers.__version__)') renders as committed"
