"""Network topology as a hierarchy of levels, and the builders that produce one.

Devices are numbered so that level 0 varies fastest: device d sits in node d // f0, in level-1
unit d // (f0*f1), and so on. Two devices communicate over the lowest level whose unit holds both.
A torus is described the same way, one level per dimension (hop-distance classes), so every fabric
the planner knows reduces to the same few numbers per level.

A job's allocation is rarely that regular: 37 nodes of a SuperPOD are one full 32-node scalable unit
and a partial one of 5, and the nodes SLURM hands out hang off whatever leaves were free. Such a
tree keeps the levels (the link classes) and adds `children`: per level, how many units of the level
below each of its units holds, in device order. Units stay contiguous ranges of device ids, so the
unit of a device is a lookup, and sorted devices still give sorted units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from nest_megatron.config.schema import ClusterConfig
from nest_megatron.errors import NestError


@dataclass(frozen=True)
class Level:
    name: str
    fan_out: int  # units of the level below in one unit of this level
    bandwidth: float  # per device per direction, B/s
    latency: float  # s
    oversubscription: float = 1.0
    # The fraction of `bandwidth` collectives reach at this level (NCCL's protocol and the fabric's congestion):
    # the cluster config's (cluster.levels[i].efficiency, 1 unless set); a calibration fits it from a cluster's runs.
    efficiency: float = 1.0
    # The fraction of that an all-to-all (the MoE dispatch, a2a context parallelism) reaches (cost/collectives.py)
    all_to_all_efficiency: float = 1.0


@dataclass(frozen=True)
class Topology:
    name: str
    levels: tuple[Level, ...]
    host_level: int = 0  # the level whose unit is one host (torchrun node); lower levels are inside it
    # An irregular tree: children[l][u] = units of level l - 1 (devices for l = 0) in unit u of level l,
    # units in device order; the top level has one unit. None: every unit of level l holds fan_out.
    children: tuple[tuple[int, ...], ...] | None = None
    hosts: tuple[str, ...] | None = None  # the allocation's node names in device order (cluster.nodes); None: unnamed
    # The highest level whose links are NVLink (cluster.nvlink_level): a unit of it is one NVLink domain, which may
    # hold several hosts (a GB200 NVL72 rack of 18 trays). None: the host level (NVLink ends at the host).
    nvlink_level: int | None = None
    # The whole allocation, failed nodes included (cluster.failed_nodes), for the report to draw; None: none failed.
    allocation: Topology | None = field(default=None, compare=False, repr=False)
    _unit_ids: tuple = field(default=(), compare=False, hash=False, repr=False)
    # num_devices, counted once: the search asks it of every configuration it checks (over a million at 1,152 GPUs)
    _num_devices: int = field(init=False, default=0, compare=False, hash=False, repr=False)

    def __post_init__(self):
        devices = sum(self.children[0]) if self.children is not None else math.prod(lv.fan_out for lv in self.levels)
        object.__setattr__(self, "_num_devices", devices)
        if self.children is None:
            return
        assert len(self.children) == len(self.levels) and len(self.children[-1]) == 1, "one unit at the top"
        ids, sizes = [], list(self.children[0])  # sizes: devices of each unit of the current level
        ids.append(np.repeat(np.arange(len(sizes)), sizes))
        for level in range(1, len(self.levels)):
            counts = self.children[level]
            assert sum(counts) == len(sizes), f"level {level} holds {sum(counts)} units of {len(sizes)}"
            bounds = np.cumsum((0, *counts))
            sizes = [sum(sizes[bounds[u]:bounds[u + 1]]) for u in range(len(counts))]
            ids.append(np.repeat(np.arange(len(sizes)), sizes))
        object.__setattr__(self, "_unit_ids", tuple(ids))

    @property
    def failed_hosts(self) -> tuple[str, ...]:
        """The allocation's nodes this topology leaves out (cluster.failed_nodes), in the allocation's order."""
        if self.allocation is None:
            return ()
        working = set(self.hosts or ())
        return tuple(h for h in self.allocation.hosts if h not in working)

    @property
    def regular(self) -> bool:
        return self.children is None

    @property
    def num_devices(self) -> int:
        return self._num_devices

    def unit_of(self, level: int, devices):
        """The level-`level` unit of each device in `devices` (an int or an array): numbered in device order."""
        if self.children is None:
            return devices // self.unit_size(level)
        return self._unit_ids[level][devices]

    def unit_sizes(self, level: int) -> tuple[int, ...]:
        """Devices in each unit of `level`, in device order."""
        if self.children is None:
            return (self.unit_size(level),) * (self.num_devices // self.unit_size(level))
        return tuple(np.bincount(self._unit_ids[level]).tolist())

    def num_units(self, level: int) -> int:
        return len(self.unit_sizes(level)) if self.children is not None else self.num_devices // self.unit_size(level)

    @property
    def devices_per_node(self) -> int:
        """Devices of one host: what torchrun calls a node."""
        return self.unit_size(min(self.host_level, len(self.levels) - 1))

    @property
    def domain_level(self) -> int:
        """The level whose unit is one NVLink domain: cluster.nvlink_level, else the host's (of the levels kept)."""
        level = self.nvlink_level if self.nvlink_level is not None else self.host_level
        return min(level, len(self.levels) - 1)

    @property
    def domain_devices(self) -> int:
        """A size whose divisors, as groups of consecutive devices from device 0, never straddle two NVLink domains:
        the greatest common divisor of the device offsets where a domain ends and the next begins, the first
        domain's size among them (one domain: its size). 72 on full NVL72 racks; 40 on an allocation of 10 and 8
        trays of two racks (domains of 40 and 32, the one boundary at device 40); 4 on 10, 9 and 10 trays
        (boundaries at 40 and 76). With NVLink ending at the host it is the host's devices. The search's TP sizes
        divide it (solver/space.py tensor_parallel_sizes)."""
        ends = np.cumsum(self.unit_sizes(self.domain_level))
        return math.gcd(*ends[:-1].tolist()) if len(ends) > 1 else int(ends[0])

    def unit_size(self, level: int) -> int:
        """Devices in one unit of `level`; in an irregular tree only for the levels up to the host, which are
        whole (the nodes of an allocation are alike)."""
        assert self.children is None or level <= self.host_level, "units above the host differ in size"
        return math.prod(lv.fan_out for lv in self.levels[: level + 1])

    def rescaled(self, num_devices: int) -> Topology:
        """The same fabric with `num_devices` devices.

        More devices than described grow the top level; fewer keep the lowest levels whose units
        hold them (16 GPUs of a superpod: two nodes of one scalable unit, no spine). A count that
        whole units of the level below do not make (37 nodes of 32-node units) fills the units in
        order: full ones, then one partial unit (`partial_tree`).
        """
        if num_devices <= 0:
            raise NestError(f"cluster.num_devices={num_devices}: must be positive")
        top = next((lvl for lvl in range(len(self.levels)) if self.unit_size(lvl) >= num_devices), len(self.levels) - 1)
        below = self.unit_size(top - 1) if top > 0 else 1
        if num_devices % below == 0:
            level = replace(self.levels[top], fan_out=num_devices // below)
            return replace(self, levels=(*self.levels[:top], level))
        host = self.devices_per_node
        if top <= self.host_level or num_devices % host:
            unit, name = (below, self.levels[top - 1].name) if top <= self.host_level else (host, self.levels[self.host_level].name)
            raise NestError(f"cluster.num_devices={num_devices}: must be a multiple of {unit} "
                            f"(the devices in one {name} of cluster {self.name})")
        return partial_tree(self, num_devices // host, top=top)


def partial_tree(topology: Topology, num_nodes: int, *, top: int) -> Topology:
    """The first `num_nodes` hosts of `topology`'s regular tree, levels up to `top`: above the host, full
    units in order and one partial unit per level (37 nodes of 32-node units: 32 + 5)."""
    h = topology.host_level
    children = [(lv.fan_out,) * (num_nodes * topology.devices_per_node // topology.unit_size(lvl))
                for lvl, lv in enumerate(topology.levels[: h + 1])]
    units = num_nodes
    for lvl in range(h + 1, top):
        fan = topology.levels[lvl].fan_out
        counts = (fan,) * (units // fan) + ((units % fan,) if units % fan else ())
        children.append(counts)
        units = len(counts)
    children.append((units,))
    return irregular(topology, tuple(children))


def without_hosts(topology: Topology, gone: set[str]) -> Topology:
    """`topology` (with named hosts) less the hosts in `gone`: every other host stays in its units, which shrink,
    and a unit left empty is dropped (a failed node's scalable unit holds one node fewer; the others do not move)."""
    per, h = topology.devices_per_node, topology.host_level
    kept = [i for i, name in enumerate(topology.hosts) if name not in gone]
    children = [(lv.fan_out,) * (len(kept) * per // topology.unit_size(lvl))
                for lvl, lv in enumerate(topology.levels[: h + 1])]
    below = np.arange(len(kept))  # the unit of each kept host at the level below: itself at first
    for level in range(h + 1, len(topology.levels)):
        units = topology.unit_of(level, np.asarray(kept) * per)
        # per unit of this level, in order, the distinct units of the level below that are left in it
        starts = np.flatnonzero(np.diff(units, prepend=-1))
        new_below = np.flatnonzero(np.diff(below, prepend=-1))
        children.append(tuple(np.diff(np.searchsorted(new_below, [*starts, len(kept)])).tolist()))
        below = units
    return irregular(topology, tuple(children), tuple(topology.hosts[i] for i in kept))


def irregular(topology: Topology, children: tuple[tuple[int, ...], ...], hosts: tuple[str, ...] | None = None) -> Topology:
    """`topology`'s lowest len(children) levels over the tree `children`; each level's fan_out becomes its
    largest unit's, as the report draws it."""
    levels = tuple(replace(lv, fan_out=max(counts)) for lv, counts in zip(topology.levels, children))
    return Topology(topology.name, levels, topology.host_level, children, hosts, nvlink_level=topology.nvlink_level)


def hierarchical(cfg: ClusterConfig) -> Topology:
    levels = tuple(
        Level(
            name=lv.name,
            fan_out=lv.fan_out,
            bandwidth=lv.bandwidth_gb_per_s * 1e9,
            latency=lv.latency_s,
            oversubscription=lv.oversubscription,
            efficiency=lv.efficiency,
            all_to_all_efficiency=lv.all_to_all_efficiency,
        )
        for lv in cfg.levels
    )
    if not 0 <= cfg.host_level < len(levels):
        raise NestError(f"cluster.host_level={cfg.host_level}: must name one of the {len(levels)} levels "
                        f"({', '.join(f'{i}: {lv.name}' for i, lv in enumerate(levels))})")
    if cfg.nvlink_level is not None and not cfg.host_level <= cfg.nvlink_level < len(levels):
        raise NestError(f"cluster.nvlink_level={cfg.nvlink_level}: must name a level at or above cluster.host_level="
                        f"{cfg.host_level} (an NVLink domain holds whole hosts): "
                        f"{', '.join(f'{i}: {lv.name}' for i, lv in enumerate(levels) if i >= cfg.host_level)}")
    return Topology(name=cfg.name, levels=levels, host_level=cfg.host_level, nvlink_level=cfg.nvlink_level)


def torus(cfg: ClusterConfig) -> Topology:
    """One level per torus dimension.

    A ring along one dimension of a torus uses both of a chip's links in that dimension, so a
    device moves 2 x link bandwidth per direction there; the mean distance to a peer along a ring of
    k chips is k/4 hops, which sets the level's latency.
    """
    spec = cfg.torus
    levels = tuple(
        Level(
            name=f"dim{i}",
            fan_out=k,
            bandwidth=2 * spec.link_bandwidth_gb_per_s * 1e9,
            latency=spec.hop_latency_s * max(1.0, k / 4),
        )
        for i, k in enumerate(spec.dims)
    )
    if cfg.host_level != 0:
        raise NestError(f"cluster.host_level={cfg.host_level}: a torus has one host per chip group of dim0; use 0")
    if cfg.nvlink_level is not None:
        raise NestError(f"cluster.nvlink_level={cfg.nvlink_level}: a torus has no NVLink domain (its levels are the "
                        "torus dimensions); leave it unset")
    return Topology(name=cfg.name, levels=levels)


# Topology builders by the name `cluster.topology` takes.
BUILDERS = {"hierarchical": hierarchical, "torus": torus}
