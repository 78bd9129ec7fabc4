"""Which network levels each parallel group of a configuration spans, for one rank -> device map."""

from __future__ import annotations

import math
from functools import cached_property, lru_cache

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


class Spans:
    """Per kind of group, its distinct shapes on the topology; per pipeline boundary, its level. Each is worked out
    when first asked for: the search's bounds ask only for a layer's groups (tp, cp, ep) of most configurations."""

    def __init__(self, cfg: ParallelConfig, topology: Topology, rank_to_device: np.ndarray | None):
        """`rank_to_device` None: rank r on device r."""
        self._cfg, self._topology, self._rank_to_device = cfg, topology, rank_to_device

    @property
    def _devices(self) -> np.ndarray:
        """The rank -> device map, Megatron's own (rank r on device r) when none was given."""
        return identity_placement(self._cfg.world) if self._rank_to_device is None else self._rank_to_device

    def _shapes(self, sizes: dict[str, int], token: str) -> tuple[GroupShape, ...]:
        if self._rank_to_device is None:
            return _identity_shapes(self._topology, *identity_key(self._cfg.order, sizes, token))
        groups = rank_groups(self._cfg.order, sizes, token)
        return tuple(group_shapes(groups, self._rank_to_device, self._topology))

    @cached_property
    def tp(self) -> tuple[GroupShape, ...]:
        return self._shapes(decoder_sizes(self._cfg), "tp")

    @cached_property
    def cp(self) -> tuple[GroupShape, ...]:
        return self._shapes(decoder_sizes(self._cfg), "cp")

    @cached_property
    def dp(self) -> tuple[GroupShape, ...]:  # the dense-gradient group: dp x cp
        return self._shapes(decoder_sizes(self._cfg), "dp-cp")

    @cached_property
    def ep(self) -> tuple[GroupShape, ...]:
        return self._shapes(expert_sizes(self._cfg), "ep")

    @cached_property
    def etp(self) -> tuple[GroupShape, ...]:
        return self._shapes(expert_sizes(self._cfg), "tp")

    @cached_property
    def edp(self) -> tuple[GroupShape, ...]:  # the expert-gradient group
        return self._shapes(expert_sizes(self._cfg), "dp")

    @cached_property
    def dp_instance(self) -> tuple[GroupShape, ...]:  # the dense-gradient group within one optimizer instance
        return self.dp if self._cfg.distributed_optimizer_instances == 1 else self._partial("dp", across=False)

    @cached_property
    def dp_across(self) -> tuple[GroupShape, ...]:  # the same shard's ranks of every optimizer instance
        return self._partial("dp", across=True)

    @cached_property
    def edp_instance(self) -> tuple[GroupShape, ...]:
        return self.edp if self._cfg.distributed_optimizer_instances == 1 else self._partial("edp", across=False)

    @cached_property
    def edp_across(self) -> tuple[GroupShape, ...]:
        return self._partial("edp", across=True)

    def _partial(self, kind: str, *, across: bool) -> tuple[GroupShape, ...]:
        """The `kind` ("dp" or "edp") groups split over the distributed-optimizer instances as megatron-core splits
        them: an instance holds a contiguous chunk of each group's ranks, the ranks of one shard in every instance
        are strided (parallel_state.py:984-1000, 1474-1490 create_hierarchical_groups, at d98e8a6)."""
        sizes, token = (decoder_sizes(self._cfg), "dp-cp") if kind == "dp" else (expert_sizes(self._cfg), "dp")
        groups = rank_groups(self._cfg.order, sizes, token)
        instances = self._cfg.distributed_optimizer_instances
        parts = groups.reshape(len(groups), instances, groups.shape[1] // instances)
        parts = parts.transpose(0, 2, 1) if across else parts
        return tuple(group_shapes(parts.reshape(-1, parts.shape[-1]), self._devices, self._topology))

    @cached_property
    def pp_boundary_level(self) -> tuple[int, ...]:  # boundary i sits between stage i and i + 1
        pp_groups = rank_groups(self._cfg.order, decoder_sizes(self._cfg), "pp")
        return boundary_levels(pp_groups, self._devices, self._topology)

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


def identity_key(order: str, sizes: dict[str, int], token: str) -> tuple[tuple, int]:
    """What the shapes of `token`'s groups depend on with rank r on device r: the dimensions of `order` up to the
    last one the token names (each with its size and whether the token names it), and the world. The dimensions after
    it vary between groups only, as one outer dimension of world / (the prefix's product) ranks: the same groups."""
    names = order.split("-") + [n for n in sizes if n not in order.split("-")]
    masked = token.split("-")
    prefix = names[:max(names.index(n) for n in masked) + 1]
    return tuple((n, sizes.get(n, 1), n in masked) for n in prefix), math.prod(sizes.values())


@lru_cache(maxsize=4096)
def _identity_shapes(topology: Topology, prefix: tuple, world: int) -> tuple[GroupShape, ...]:
    """`Spans._shapes` with rank r on device r, shared by the configurations whose groups are the same (TP groups
    depend on TP and the world only)."""
    sizes = {name: size for name, size, _ in prefix}
    sizes["outer"] = world // math.prod(sizes.values())
    order = "-".join([*sizes])
    groups = rank_groups(order, sizes, "-".join(name for name, _, masked in prefix if masked))
    return tuple(group_shapes(groups, identity_placement(world), topology))


def compute_spans(cfg: ParallelConfig, topology: Topology, rank_to_device: np.ndarray | None) -> Spans:
    return Spans(cfg, topology, rank_to_device)


@lru_cache(maxsize=8192)
def _cached_spans(tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, order: str, instances: int, topology: Topology,
                  mapping: bytes | None) -> Spans:
    cfg = ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, order=order, distributed_optimizer_instances=instances)
    return compute_spans(cfg, topology, None if mapping is None else np.frombuffer(mapping, dtype=np.int64))


def spans_for(cfg: ParallelConfig, topology: Topology, rank_to_device: np.ndarray | None) -> Spans:
    """Spans of `cfg` under `rank_to_device` (None: rank r on device r), shared by every
    configuration with the same group sizes and map: ZeRO, recompute, micro-batch do not move them."""
    mapping = None if rank_to_device is None else np.asarray(rank_to_device, dtype=np.int64).tobytes()
    return _cached_spans(cfg.tp, cfg.cp, cfg.dp, cfg.pp, cfg.ep, cfg.etp, cfg.order, cfg.distributed_optimizer_instances,
                         topology, mapping)
