"""Which network levels each parallel group of a configuration spans, for one rank -> device map."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nest_megatron.hardware.topology import Topology
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import (
    GroupShape,
    decoder_sizes,
    expert_sizes,
    group_shapes,
    identity_placement,
    rank_groups,
)


@dataclass(frozen=True)
class Spans:
    """Per kind of group, its distinct shapes on the topology; per pipeline boundary, its level."""

    tp: tuple[GroupShape, ...]
    cp: tuple[GroupShape, ...]
    dp: tuple[GroupShape, ...]  # the dense-gradient group: dp x cp
    ep: tuple[GroupShape, ...]
    etp: tuple[GroupShape, ...]
    edp: tuple[GroupShape, ...]  # the expert-gradient group
    pp_boundary_level: tuple[int, ...]  # boundary i sits between stage i and i + 1

    def levels_used(self, *, moe: bool) -> dict[str, int]:
        """The highest level each group kind crosses (-1: no communication); the expert groups
        only for a MoE model."""
        out = {}
        for kind in ("tp", "cp", "dp") + (("ep", "etp", "edp") if moe else ()):
            out[kind] = max(shape.top_level for shape in getattr(self, kind))
        out["pp"] = max(self.pp_boundary_level, default=-1)
        return out


def boundary_levels(pp_groups: np.ndarray, rank_to_device: np.ndarray, topology: Topology) -> tuple[int, ...]:
    """For each pair of consecutive stages, the highest level any of its transfers crosses."""
    devices = rank_to_device[pp_groups]  # [groups, pp]
    levels = []
    for stage in range(pp_groups.shape[1] - 1):
        a, b = devices[:, stage], devices[:, stage + 1]
        level = -1
        for lvl in range(len(topology.levels)):
            if np.any(topology.unit_of(lvl, a) != topology.unit_of(lvl, b)):
                continue
            level = lvl
            break
        levels.append(level)
    return tuple(levels)


def compute_spans(cfg: ParallelConfig, topology: Topology, rank_to_device: np.ndarray) -> Spans:
    dec, exp = decoder_sizes(cfg), expert_sizes(cfg)

    def shapes(sizes: dict[str, int], token: str) -> tuple[GroupShape, ...]:
        return tuple(group_shapes(rank_groups(cfg.order, sizes, token), rank_to_device, topology))

    return Spans(
        tp=shapes(dec, "tp"),
        cp=shapes(dec, "cp"),
        dp=shapes(dec, "dp-cp"),
        ep=shapes(exp, "ep"),
        etp=shapes(exp, "tp"),
        edp=shapes(exp, "dp"),
        pp_boundary_level=boundary_levels(rank_groups(cfg.order, dec, "pp"), rank_to_device, topology),
    )


@lru_cache(maxsize=8192)
def _cached_spans(tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, order: str, topology: Topology,
                  mapping: bytes | None) -> Spans:
    cfg = ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, order=order)
    rank_to_device = identity_placement(cfg.world) if mapping is None else np.frombuffer(mapping, dtype=np.int64)
    return compute_spans(cfg, topology, rank_to_device)


def spans_for(cfg: ParallelConfig, topology: Topology, rank_to_device: np.ndarray | None) -> Spans:
    """Spans of `cfg` under `rank_to_device` (None: rank r on device r), shared by every
    configuration with the same group sizes and map: ZeRO, recompute, micro-batch do not move them."""
    mapping = None if rank_to_device is None else np.asarray(rank_to_device, dtype=np.int64).tobytes()
    return _cached_spans(cfg.tp, cfg.cp, cfg.dp, cfg.pp, cfg.ep, cfg.etp, cfg.order, topology, mapping)
