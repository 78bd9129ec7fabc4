"""The NEST paper's baseline configurations (benchmarks/nest_paper_grid.yaml) as plan.* overrides.

The grid gives (p, d, t) triples. One is launchable in Megatron only when p divides the layers,
p*d*t fits on the cluster and the global batch splits into whole micro-batches over d replicas;
the others are returned with the reason they were skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    return yaml.safe_load(GRID_PATH.read_text())


def baselines(*, cluster: str, num_devices: int, model: str, num_layers: int, global_batch_size: int, micro_batch_size: int = 1) -> list[Baseline]:
    grid = load_grid()["baselines"].get(BASELINE_KEYS.get(cluster, cluster), {})
    out = []
    for name, models in grid.get(num_devices, {}).items():
        if model not in models:
            continue
        entry = models[model]
        p, d, t = entry["p"], entry["d"], entry["t"]
        reason = None
        if num_layers % p:
            reason = f"p={p} does not divide {num_layers} layers"
        elif p * d * t > num_devices:
            reason = f"p*d*t={p * d * t} exceeds {num_devices} devices"
        elif global_batch_size % (micro_batch_size * d):
            reason = f"global batch {global_batch_size} is not a multiple of d={d} x micro-batch {micro_batch_size}"
        elif global_batch_size // (micro_batch_size * d) < p:
            reason = f"{global_batch_size // (micro_batch_size * d)} micro-batches cannot fill p={p} stages"
        elif "layer_partition" in entry:
            reason = "an uneven layer partition (planned by the DP solver, not the enumerator)"
        overrides = None if reason else [f"plan.pp={p}", f"plan.dp={d}", f"plan.tp={t}", f"plan.mbs={micro_batch_size}"]
        out.append(Baseline(name=name, overrides=overrides, skipped=reason))
    return out
