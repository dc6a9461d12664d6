#!/usr/bin/env bash
# Optional: a Python venv with torch, transformers, safetensors, peft, bitsandbytes and trl under
# build/hf-venv, for the tests that compare meshtrain with models transformers
# writes itself (tests/reference/hf_models.py, ctest -R hf_venv; trl: ctest -R dpo_trl and
# bench/torch_dpo.py). Not part of
# scripts/setup.sh: the download is large and CI does not need it (the committed
# fixtures in tests/reference/fixtures/hf_tiny_* are checked without it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/build/hf-venv}
/usr/bin/python3 -m venv "$venv"  # Debian's, whatever python is first on PATH
"$venv/bin/pip" install torch transformers safetensors peft bitsandbytes trl
"$venv/bin/python" -c "import torch, transformers, peft, trl; print('hf venv:', '$venv', 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__)"
