#!/usr/bin/env bash
# The GPU code paths on a machine with one GPU, in under 8 minutes: EDSR batched vs unbatched on
# CUDA (fp16), the HF engine's tokens/s (tiny model; a random-init Qwen-shaped ~0.5B model), and
# the weight-update time of that model into a generating process through CUDA IPC vs a CPU copy, and
# (with DeepSpeed) the learner's SFT and GRPO steps on one NCCL rank, bf16, ZeRO-3, and its peak GPU
# memory beside jobs/grpo.py --check's estimate.
#
#   bench/gpu_check.sh                 # uses $PYTHON, else .venv/bin/python, else python3
#
# Needs only torch (with CUDA), transformers, numpy and pillow, plus basicsr (its EDSR source;
# `pip install --no-deps basicsr==1.4.2`) and this checkout on PYTHONPATH: no Ray, vLLM or
# DeepSpeed (DeepSpeed only for the learner part: `pip install --no-deps deepspeed`), so it runs on a
# bare GPU box. Parts that need what is missing print
# `skipped: <reason>`. The last line is one JSON object; `ratio` = EDSR batched / unbatched.
# Without a GPU it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: skipped: no CUDA GPU visible to $PY (torch.cuda.is_available() is False)"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 470 "$PY" bench/gpu_check.py "$@"
