#!/usr/bin/env bash
# Validate nest-megatron's predictions on this machine's NVIDIA GPUs: profile, plan, train a ~1B
# model with megatron-core for a few micro-batch sizes and recompute settings (TP / PP with two or
# more GPUs), and write predicted against measured step time and peak memory to
# docs/validation/<date>_<gpu>.md, and the profile cache to nest_megatron/profile/shipped/<gpu>.json.
# Under 8 minutes on one H100 / H200. `--cpu-smoke --out-dir DIR` runs the same steps at tiny
# size on a CPU (tests/test_validate_on_gpu.py does, so that this script cannot rot).
#
# It runs from this checkout without installing it, on any Python that holds PyTorch ($PYTHON, else
# python3). On a node with no network, `--wheels DIR` first installs the wheels that
# scripts/offline_wheels.sh fetched (megatron-core, hydra-core, ...) into a scratch folder.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
args=()
wheels=
while [[ $# -gt 0 ]]; do
  if [[ $1 == --wheels ]]; then
    [[ $# -ge 2 ]] || { echo "validate_on_gpu: error: --wheels needs a folder (scripts/offline_wheels.sh makes one)" >&2; exit 2; }
    wheels=$2
    shift 2
  else
    args+=("$1")
    shift
  fi
done

site=
if [[ -n $wheels ]]; then
  compgen -G "$wheels/*.whl" >/dev/null \
    || { echo "validate_on_gpu: error: --wheels $wheels: no .whl files there (scripts/offline_wheels.sh makes them)" >&2; exit 2; }
  site=$(mktemp -d)/site
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
fi
# The checkout first: its code is what is validated, whatever else is installed.
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/validate_on_gpu.py "${args[@]}"
