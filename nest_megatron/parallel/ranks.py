"""Megatron's rank groups and the network levels each group spans.

`rank_groups` reproduces megatron-core's RankGenerator / generate_masked_orthogonal_rank_groups
(parallel_state.py) with numpy, so it runs without torch and at 65,536 ranks; a test checks that
both give the same groups. `group_shape` maps a group through the rank -> device map onto the
topology and counts, per level, how many units of the level below it joins.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nest_megatron.hardware.topology import Topology
from nest_megatron.parallel.config import ParallelConfig


def rank_groups(order: str, sizes: dict[str, int], token: str) -> np.ndarray:
    """Groups of ranks that differ only in the dimensions named in `token` ("tp", "dp-cp", ...).

    `order` lists the dimensions fastest first (tp-cp-ep-dp-pp: tp neighbours are adjacent
    ranks). Returns an array [num_groups, group_size] in megatron-core's order: groups enumerated
    with the first unmasked dimension fastest, ranks inside a group with the first masked
    dimension fastest.
    """
    names = order.split("-")
    names += [n for n in sizes if n not in names]
    dims = [sizes.get(n, 1) for n in names]
    world = int(np.prod(dims))
    grid = np.arange(world).reshape(dims[::-1])  # axis j holds dimension len(dims)-1-j
    masked = set(token.split("-"))
    axis_of = {name: len(names) - 1 - i for i, name in enumerate(names)}
    unmasked_axes = [axis_of[n] for n in reversed(names) if n not in masked]
    masked_axes = [axis_of[n] for n in reversed(names) if n in masked]
    group_size = int(np.prod([sizes.get(n, 1) for n in names if n in masked]))
    return grid.transpose(unmasked_axes + masked_axes).reshape(-1, group_size)


def decoder_sizes(cfg: ParallelConfig) -> dict[str, int]:
    return {"tp": cfg.tp, "cp": cfg.cp, "ep": 1, "dp": cfg.dp, "pp": cfg.pp}


def expert_sizes(cfg: ParallelConfig) -> dict[str, int]:
    """megatron-core's expert rank generator: tp=etp, ep, dp=expert_dp, cp=1, same order."""
    return {"tp": cfg.etp, "cp": 1, "ep": cfg.ep, "dp": cfg.expert_dp, "pp": cfg.pp}


@dataclass(frozen=True)
class GroupShape:
    """How a group spreads over the network levels.

    fan_in[l] is the mean number of level-(l-1) units (devices for l = 0) of the group inside each
    of its level-l units; the product over levels is the group size. For the regular groups of
    Megatron's orders every unit holds the same number; otherwise the mean is the model.
    """

    fan_in: tuple[float, ...]

    @property
    def size(self) -> int:
        return round(float(np.prod(self.fan_in)))

    @property
    def top_level(self) -> int:
        """The highest level the group crosses (-1 for a group of one)."""
        crossing = [lvl for lvl, n in enumerate(self.fan_in) if n > 1.0 + 1e-9]
        return max(crossing, default=-1)


def group_shapes(groups: np.ndarray, rank_to_device: np.ndarray, topology: Topology) -> list[GroupShape]:
    """The distinct shapes of `groups` (ranks) once placed by `rank_to_device`."""
    if groups.shape[1] == 1:  # groups of one (cp = 1, ep = 1, ...): at 65,536 ranks the general path costs 10 ms
        return [GroupShape((1.0,) * len(topology.levels))]
    # Sorted device ids give sorted unit ids at every level (units are contiguous ranges of devices,
    # in order, regular or not), so one sort serves all levels.
    devices = np.sort(rank_to_device[groups], axis=1)
    counts = [np.full(len(groups), groups.shape[1])]  # distinct devices, then units per level
    for level in range(len(topology.levels)):
        units = topology.unit_of(level, devices)
        counts.append(1 + np.count_nonzero(np.diff(units, axis=1), axis=1))
    counts = np.stack(counts)
    if (counts == counts[:, :1]).all():  # Megatron's regular groups: one shape, without a set of 65,536 tuples
        distinct_rows = [tuple(counts[:, 0].tolist())]
    else:
        distinct_rows = sorted(set(zip(*counts.tolist())))
    return [GroupShape(tuple(row[lvl] / row[lvl + 1] for lvl in range(len(row) - 1))) for row in distinct_rows]


def inside_units(groups: np.ndarray, rank_to_device: np.ndarray, topology: Topology, level: int) -> bool:
    """Whether every group of `groups` (ranks) sits, placed by `rank_to_device`, inside one unit of `level`."""
    units = topology.unit_of(level, np.asarray(rank_to_device)[groups])
    return bool((units == units[:, :1]).all())


def identity_placement(world: int) -> np.ndarray:
    """Rank r on device r: Megatron's default when torchrun assigns ranks node by node."""
    return np.arange(world)


def node_permutations(order: str, sizes: dict[str, int], devices_per_node: int) -> list[np.ndarray]:
    """Rank -> device maps that torchrun can realise by giving node ranks to the hosts in another
    order (each node keeps a block of consecutive ranks, issue: launch).

    The rank dimensions that vary across nodes (fastest first in `order`; one that straddles the
    node boundary is split into its part inside and its part across) are laid out over the nodes
    in every order of those dimensions, e.g. with tp-cp-ep-dp-pp either consecutive nodes hold
    data-parallel replicas (Megatron's layout) or pipeline neighbours. The identity comes first.
    """
    names = [n for n in order.split("-") if sizes.get(n, 1) > 1]
    world = int(np.prod([sizes[n] for n in names])) if names else 1
    identity = identity_placement(world)
    if world % devices_per_node or world // devices_per_node == 1:
        return [identity]
    inside, across = 1, []
    for name in names:
        size = sizes[name]
        if inside * size <= devices_per_node:
            inside *= size
        elif inside < devices_per_node:
            if (devices_per_node % inside) or (size % (devices_per_node // inside)):
                return [identity]
            split = devices_per_node // inside
            inside = devices_per_node
            across.append(size // split)
        else:
            across.append(size)
    num_nodes = world // devices_per_node
    block = np.arange(num_nodes).reshape(across[::-1])  # axis j holds across-dimension len-1-j
    maps, seen = [identity], {tuple(range(num_nodes))}
    for perm in itertools.permutations(range(len(across))):
        # Node of a block = mixed radix of its across-indices, taken in the order `perm`.
        axes = [len(across) - 1 - d for d in perm][::-1]
        node_of_block = np.empty(num_nodes, dtype=int)
        node_of_block[block.transpose(axes).reshape(-1)] = np.arange(num_nodes)
        key = tuple(node_of_block)
        if key not in seen:
            seen.add(key)
            ranks = np.arange(world)
            maps.append(node_of_block[ranks // devices_per_node] * devices_per_node + ranks % devices_per_node)
    return maps


def sizes_inside(order: str, sizes: dict[str, int], devices: int) -> dict[str, int]:
    """The part of each rank dimension that lies inside a block of `devices` consecutive ranks
    (fastest dimension first in `order`; the one straddling the block boundary contributes the
    factor that fills it, when it divides)."""
    inside, out = 1, {}
    for name in (n for n in order.split("-") if sizes.get(n, 1) > 1):
        take = math.gcd(sizes[name], max(devices // inside, 1))
        if take > 1:
            out[name] = take
            inside *= take
    return out


def host_placements(order: str, sizes: dict[str, int], devices_per_host: int, devices_per_unit: int) -> list[np.ndarray]:
    """Rank -> device maps over the hosts' order (`node_permutations`) combined with the orders of
    the sub-host units inside each host (NVLink pairs, PCIe switches: units of `devices_per_unit`),
    which CUDA_VISIBLE_DEVICES realises. Every host uses the same order inside. Identity first.
    Memoised (the configurations that differ in ZeRO, recompute or micro-batch share them); the
    arrays are read-only."""
    return _host_placements(order, tuple(sorted(sizes.items())), devices_per_host, devices_per_unit)


@lru_cache(maxsize=4096)
def _host_placements(order: str, size_items: tuple, devices_per_host: int, devices_per_unit: int) -> list[np.ndarray]:
    maps = _compose_host_placements(order, dict(size_items), devices_per_host, devices_per_unit)
    for m in maps:
        m.flags.writeable = False
    return maps


def _compose_host_placements(order: str, sizes: dict[str, int], devices_per_host: int,
                             devices_per_unit: int) -> list[np.ndarray]:
    hosts = node_permutations(order, sizes, devices_per_host)
    if devices_per_unit >= devices_per_host:
        return hosts
    inside = sizes_inside(order, sizes, devices_per_host)
    world = math.prod(sizes.values())
    if math.prod(inside.values()) != min(devices_per_host, world):
        return hosts  # a dimension straddles the host boundary unevenly: keep Megatron's order inside
    local = node_permutations(order, inside, devices_per_unit)
    maps = []
    for host_map in hosts:
        for local_map in local:
            ranks = np.arange(len(host_map))
            maps.append(host_map - host_map % devices_per_host + local_map[ranks % len(local_map)])
    return maps
