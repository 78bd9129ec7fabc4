"""The NEST paper's baseline configurations (benchmarks/nest_paper_grid.yaml) as plan.* overrides.

The grid gives (p, d, t) triples. For a model with the grid's `expert_parallel` e (Mixtral: 4, as in
the paper's runs) each of the d replicas spans e devices: its experts split e ways, its other layers
data-parallel over those e devices, as Megatron carves expert parallel out of data parallel. So the
entry runs with Megatron's dp = d*e and ep = e on p*d*t*e devices; read so, every Mixtral entry fills
its cluster, except the two the artifact reports infeasible or never launches (Manual's p=32, d=1 on
64 TPU v4 needs 128; MCMC's p=33 on 1,024 H100 does not divide the 32 layers).

An entry is launchable in Megatron only when p divides the layers, p*d*t*e fits on the cluster and
the global batch splits into whole micro-batches over dp replicas; the others are returned with the
reason they were skipped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

GRID_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "nest_paper_grid.yaml"
# The grid's cluster keys for baselines differ from its cluster names.
BASELINE_KEYS = {"h100_spine_leaf": "h100_spineLeaf", "tpuv4_fat_tree": "tpuv4_fatTree"}


@dataclass(frozen=True)
class Baseline:
    name: str  # Manual | MCMC | Phaze
    overrides: list[str] | None  # plan.* overrides, None when not launchable
    skipped: str | None  # why not launchable


def load_grid() -> dict:
    """The grid, parsed once per content of its file (YAML parsing took ~40 ms a call, and a sweep over the grid
    asks for it per cell); each caller gets its own copy."""
    return copy.deepcopy(_parsed(GRID_PATH.read_bytes()))


@lru_cache(maxsize=2)
def _parsed(text: bytes) -> dict:
    return yaml.safe_load(text)


def baselines(*, cluster: str, num_devices: int, model: str, num_layers: int, global_batch_size: int, micro_batch_size: int = 1) -> list[Baseline]:
    grid = load_grid()
    ep = grid["models"].get(model, {}).get("expert_parallel", 1)
    entries = grid["baselines"].get(BASELINE_KEYS.get(cluster, cluster), {})
    out = []
    for name, models in entries.get(num_devices, {}).items():
        if model not in models:
            continue
        entry = models[model]
        p, d, t = entry["p"], entry["d"], entry["t"]
        dp = d * ep
        reason = None
        if num_layers % p:
            reason = f"p={p} does not divide {num_layers} layers"
        elif p * dp * t > num_devices:
            reason = f"p*d*t*ep = {p}*{d}*{t}*{ep} = {p * dp * t} devices, but the cluster has {num_devices}"
        elif global_batch_size % (micro_batch_size * dp):
            reason = f"global batch {global_batch_size} is not a multiple of dp={dp} x micro-batch {micro_batch_size}"
        elif global_batch_size // (micro_batch_size * dp) < p:
            reason = f"{global_batch_size // (micro_batch_size * dp)} micro-batches cannot fill p={p} stages"
        elif "layer_partition" in entry:
            reason = "an uneven layer partition (planned by the DP solver, not the enumerator)"
        overrides = None if reason else [f"plan.pp={p}", f"plan.dp={dp}", f"plan.tp={t}", f"plan.ep={ep}",
                                         f"plan.mbs={micro_batch_size}"]
        out.append(Baseline(name=name, overrides=overrides, skipped=reason))
    return out
