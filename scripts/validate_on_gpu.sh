#!/usr/bin/env bash
# Validate nest-megatron's predictions on this machine's NVIDIA GPUs: profile, plan, train a ~1B
# model with megatron-core for a few micro-batch sizes and recompute settings (TP / PP with two or
# more GPUs), and write predicted against measured step time and peak memory to
# docs/validation/<date>_<gpu>.md, and the profile cache to data/profiles/<gpu>.json.
# Under 8 minutes on one H100 / H200. `--cpu-smoke --out-dir DIR` runs the same steps at tiny
# size on a CPU (tests/test_validate_on_gpu.py does, so that this script cannot rot).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/validate_on_gpu.py "$@"
