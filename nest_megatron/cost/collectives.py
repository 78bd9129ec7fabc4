"""Collective communication times: alpha-beta per level, hierarchical across levels.

A group that spans several levels runs the hierarchical algorithm NCCL and Megatron's 2D
collectives use: reduce-scatter inside the lowest level first, then among the level-1 peers on
the 1/n0 shard each device now holds, and so on up; all-gather mirrors it; all-reduce is the
two. Phase l among n_l peers on S_l bytes costs (n_l - 1) alpha_l + (n_l - 1)/n_l S_l / B_l, where
B_l is the device's bandwidth at that level (its own NIC share: every device of a unit sends its
shard at once, as in a rail-optimised or fat-tree fabric).

A level's bandwidth efficiency (hardware/topology.py Level.efficiency, 1 unless set) scales its bandwidth; it is
applied here, once, for every collective and transfer. An all-to-all is further scaled by the level's
`all_to_all_efficiency`: a ring step sends one large message to one peer, an all-to-all many smaller ones to every
peer at once (NCCL's send/recv pairs or DeepEP's RDMA writes), which reaches less of a NIC's line rate.

Oversubscription and sharing: a level-l switch with oversubscription o carries 1/o of what its
devices can inject. When a fraction u of the devices under it send across level l at the same
time (u = 1 when every device is busy in a group of that kind, less when devices sit idle), each
gets B_l * min(1, 1 / (o * u)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nest_megatron.hardware.topology import Topology
from nest_megatron.parallel.ranks import GroupShape


@dataclass(frozen=True)
class Network:
    """Effective per-level bandwidths and latencies for one plan."""

    bandwidth: tuple[float, ...]  # B/s per device per direction, after sharing
    latency: tuple[float, ...]  # s
    # The first level above the NVLink domain: from it up, every level is reached through the device's NIC, so a byte
    # to a peer first met at a higher level also crosses this level's links and each one between
    nic_level: int = 1
    all_to_all_bandwidth: tuple[float, ...] = ()  # B/s per device per direction an all-to-all reaches; () = bandwidth

    def __post_init__(self):
        if not self.all_to_all_bandwidth:
            object.__setattr__(self, "all_to_all_bandwidth", self.bandwidth)

    @classmethod
    def for_topology(cls, topology: Topology, *, busy_fraction: float = 1.0) -> Network:
        bandwidth = []
        for level in topology.levels:
            share = min(1.0, 1.0 / (level.oversubscription * busy_fraction)) if level.oversubscription > 1 else 1.0
            bandwidth.append(level.bandwidth * level.efficiency * share)
        all_to_all = tuple(b * lv.all_to_all_efficiency for b, lv in zip(bandwidth, topology.levels))
        return cls(tuple(bandwidth), tuple(lv.latency for lv in topology.levels), topology.domain_level + 1, all_to_all)


def when_sent(nbytes, seconds):
    """Nothing to send costs nothing, not even latency: the collective is not issued.
    Works on a number or elementwise on an array of sizes (the DP solver's tables)."""
    if isinstance(nbytes, (int, float)) or np.ndim(nbytes) == 0:  # the isinstance: a fast path for the solver
        return float(seconds) if nbytes > 0 else 0.0
    return np.where(nbytes > 0, seconds, 0.0)


def reduce_scatter_time(shape: GroupShape, nbytes, net: Network):
    """Reduce-scatter of `nbytes` per device (input size) over a group; all-gather is its mirror."""
    total, shard = 0.0, nbytes
    for level, n in enumerate(shape.fan_in):
        if n > 1.0 + 1e-9:
            total = total + (n - 1) * net.latency[level] + (n - 1) / n * shard / net.bandwidth[level]
            shard = shard / n
    return when_sent(nbytes, total)


all_gather_time = reduce_scatter_time  # output size `nbytes`: the same phases in reverse order


def all_reduce_time(shape: GroupShape, nbytes, net: Network):
    return 2.0 * reduce_scatter_time(shape, nbytes, net)


def all_to_all_time(shape: GroupShape, nbytes, net: Network):
    """All-to-all where each device holds `nbytes`, 1/n of it for each member (itself included).

    The share for peers first met at level l (inside its level-l unit, outside its level-(l-1)
    unit) crosses level l (`routed_all_to_all_time`).
    """
    n = shape.size
    if n <= 1:
        return when_sent(nbytes, 0.0)
    level_bytes, inside = [], 1.0
    for fan in shape.fan_in:
        peers = inside * fan - inside
        level_bytes.append(nbytes * peers / n)
        inside *= fan
    return when_sent(nbytes, routed_all_to_all_time(shape, tuple(level_bytes), net))


def routed_all_to_all_time(shape: GroupShape, level_bytes: tuple, net: Network):
    """An all-to-all in which each device sends `level_bytes[l]` to peers first met at level l (a MoE dispatch
    whose routing decides the shares: cost/routing.py). The levels' links work in parallel, so the slowest
    level sets the time, plus one latency per level the group crosses. Inside the NVLink domain a level's links
    carry its own peers' bytes; from `net.nic_level` up they carry every byte bound for that level or a higher one
    (a byte to another scalable unit leaves through the NIC and the leaf switch too): spreading a group over more
    units never makes it faster."""
    slowest, latency = 0.0, 0.0
    for level, fan in enumerate(shape.fan_in):
        through = level_bytes[level] if level < net.nic_level else sum(level_bytes[level:])
        slowest = np.maximum(slowest, through / net.all_to_all_bandwidth[level])
        if fan > 1.0 + 1e-9:
            latency += net.latency[level]
    return when_sent(sum(level_bytes), slowest + latency)


def p2p_time(level: int, nbytes, net: Network):
    """One point-to-point transfer between devices whose lowest common unit is `level`."""
    if level < 0:
        return when_sent(nbytes, 0.0)
    return when_sent(nbytes, net.latency[level] + nbytes / net.bandwidth[level])


def worst(time_fn, shapes, nbytes, net: Network):
    """The slowest group of a kind sets the pace: the others wait for it at the next sync."""
    times = [time_fn(shape, nbytes, net) for shape in shapes]
    return times[0] if len(times) == 1 else np.maximum.reduce(times)
