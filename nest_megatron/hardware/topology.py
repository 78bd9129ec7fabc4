"""Network topology as a hierarchy of levels, and the builders that produce one.

Devices are numbered so that level 0 varies fastest: device d sits in node d // f0, in level-1
unit d // (f0*f1), and so on. Two devices communicate over the lowest level whose unit holds both.
A torus is described the same way, one level per dimension (hop-distance classes), so every fabric
the planner knows reduces to the same few numbers per level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nest_megatron.config.schema import ClusterConfig
from nest_megatron.errors import NestError


@dataclass(frozen=True)
class Level:
    name: str
    fan_out: int  # units of the level below in one unit of this level
    bandwidth: float  # per device per direction, B/s
    latency: float  # s
    oversubscription: float = 1.0


@dataclass(frozen=True)
class Topology:
    name: str
    levels: tuple[Level, ...]
    host_level: int = 0  # the level whose unit is one host (torchrun node); lower levels are inside it

    @property
    def num_devices(self) -> int:
        return math.prod(level.fan_out for level in self.levels)

    @property
    def devices_per_node(self) -> int:
        """Devices of one host: what torchrun calls a node."""
        return self.unit_size(min(self.host_level, len(self.levels) - 1))

    def unit_size(self, level: int) -> int:
        """Devices in one unit of `level`."""
        return math.prod(lv.fan_out for lv in self.levels[: level + 1])

    def rescaled(self, num_devices: int) -> Topology:
        """The same fabric with `num_devices` devices.

        More devices than described grow the top level; fewer keep the lowest levels whose units
        hold them (16 GPUs of a superpod: two nodes of one scalable unit, no spine).
        """
        if num_devices <= 0:
            raise NestError(f"cluster.num_devices={num_devices}: must be positive")
        top = next((lvl for lvl in range(len(self.levels)) if self.unit_size(lvl) >= num_devices), len(self.levels) - 1)
        below = self.unit_size(top - 1) if top > 0 else 1
        if num_devices % below:
            raise NestError(
                f"cluster.num_devices={num_devices}: must be a multiple of {below} "
                f"(the devices in one {self.levels[top - 1].name} of cluster {self.name})"
            )
        level = replace(self.levels[top], fan_out=num_devices // below)
        return replace(self, levels=(*self.levels[:top], level))


def hierarchical(cfg: ClusterConfig) -> Topology:
    levels = tuple(
        Level(
            name=lv.name,
            fan_out=lv.fan_out,
            bandwidth=lv.bandwidth_gb_per_s * 1e9,
            latency=lv.latency_s,
            oversubscription=lv.oversubscription,
        )
        for lv in cfg.levels
    )
    if not 0 <= cfg.host_level < len(levels):
        raise NestError(f"cluster.host_level={cfg.host_level}: must name one of the {len(levels)} levels "
                        f"({', '.join(f'{i}: {lv.name}' for i, lv in enumerate(levels))})")
    return Topology(name=cfg.name, levels=levels, host_level=cfg.host_level)


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
    return Topology(name=cfg.name, levels=levels)


# Topology builders by the name `cluster.topology` takes.
BUILDERS = {"hierarchical": hierarchical, "torus": torus}
