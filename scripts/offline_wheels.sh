#!/usr/bin/env bash
# Wheels for a GPU node with no network whose Python already holds PyTorch (an NGC PyTorch container,
# a cluster's image): nest-megatron itself and what such an image usually lacks, at the versions the
# tests run with. Run it on a machine with network, copy DIR across, then on the node
#     python3 -m pip install --no-index --no-deps DIR/*.whl      (or: scripts/validate_on_gpu.sh --wheels DIR)
#
#     scripts/offline_wheels.sh DIR [--python-version 3.12] [REQUIREMENT ...]
#
# --python-version: the node's Python (default: this one's). REQUIREMENTs: more packages the node lacks,
# e.g. rich 'numba==0.62.1'; each is fetched without its dependencies, so name those too.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: scripts/offline_wheels.sh DIR [--python-version X.Y] [REQUIREMENT ...]"
[[ $# -ge 1 && $1 != -* ]] || { echo "offline_wheels: error: no DIR given; $usage" >&2; exit 2; }
dir=$1
shift
python=${PYTHON:-python3}
version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --python-version)
      [[ $# -ge 2 && $2 =~ ^3\.[0-9]+$ ]] || { echo "offline_wheels: error: --python-version takes X.Y, e.g. 3.12" >&2; exit 2; }
      version=$2
      shift 2 ;;
    -*) echo "offline_wheels: error: unknown option $1; $usage" >&2; exit 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done

# What a PyTorch image lacks. megatron-core 0.16.1 is the newest release for Python 3.11 and has wheels for 3.12.
binary=(megatron-core==0.16.1 hydra-core==1.3.2 omegaconf==2.3.0 "${extra[@]}")
# PyPI has antlr4-python3-runtime 4.9.3 (the only 4.9 that omegaconf 2.3 accepts) as source only: built here.
source_only=(antlr4-python3-runtime==4.9.3)

mkdir -p "$dir"
# The node's platform, not this machine's: manylinux x86-64 wheels for that CPython.
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$version" \
  "${platforms[@]}" -d "$dir" "${binary[@]}"
"$python" -m pip wheel -q --no-deps -w "$dir" "${source_only[@]}"
"$python" -m pip wheel -q --no-deps -w "$dir" .
echo "offline_wheels: $(ls "$dir"/*.whl | wc -l) wheels for CPython $version in $dir"
