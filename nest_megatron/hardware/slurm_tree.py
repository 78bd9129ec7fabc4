"""The allocation's switch tree: SLURM's topology.conf (tree or block plugin) and the allocated nodes, as a Topology.

Tree plugin: each line names a switch and what hangs off it: `SwitchName=s0 Nodes=n[01-20]` (a leaf) or
`SwitchName=s2 Switches=s[0-1]`. Block plugin (Slurm 23.11+, how NVL72 sites describe racks): `BlockName=b1
Nodes=n[01-18]`, one line a block, and a `BlockSizes=18,36` line (how many nodes the scheduler aggregates; not
read, nor the `AggregatedBlock=` lines scontrol prints for it). `#` starts a comment; other keys (LinkSpeed, Level, BlockIndex, BlockSize) are ignored. `scontrol show
topology` prints the same forms. The link classes (bandwidths, latencies) and the devices of a node stay those of
the named cluster config; the file only says which unit each node is in. Switch depth maps onto the config's levels
from the bottom: a node's leaf switch (or block) is the unit of the level above the host, the leaf's parent the next
level, and so on. A tree deeper than the config's levels above the host merges its upper switches into the config's
top level; a shallower one ends where its root is (the config's upper levels are not crossed). Blocks say nothing
above themselves: the config's upper levels take them in order, fan_out blocks a unit, as the block plugin
aggregates consecutive blocks (`grouped_blocks`).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from nest_megatron.errors import NestError
from nest_megatron.hardware.hostlist import expand
from nest_megatron.hardware.topology import Topology, irregular


@dataclass(frozen=True)
class SwitchTree:
    parent: dict[str, str]  # switch -> the switch above it
    leaf_of: dict[str, str]  # node -> its leaf switch (or block)
    blocks: tuple[str, ...] = ()  # the block plugin's blocks, in order; empty for a tree

    def chain(self, node: str) -> list[str]:
        """The node's switches, leaf first, up to its root."""
        out = [self.leaf_of[node]]
        while out[-1] in self.parent:
            out.append(self.parent[out[-1]])
        return out


def parse(text: str, *, source: str) -> SwitchTree:
    """topology.conf's switches; one NestError line with the line number for what is malformed."""
    parent: dict[str, str] = {}
    leaf_of: dict[str, str] = {}
    switches: set[str] = set()
    blocks: list[tuple[int, int, str]] = []  # (BlockIndex or the line, the line, name)
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        keys: dict[str, str] = {}
        for token in line.split():
            key, eq, value = token.partition("=")
            if not eq or not value:
                raise NestError(f"{where}: {token!r} is not KEY=VALUE (e.g. SwitchName=s0 Nodes=n[01-20])")
            keys[key.lower()] = value
        if set(keys) == {"blocksizes"} or "aggregatedblock" in keys:
            # the block plugin's aggregation sizes, and the aggregated blocks `scontrol show topology` prints beside the
            # base blocks (slurm src/plugins/topology/block/topology_block.c _print_topo_record): how it schedules
            continue
        name = keys.get("switchname") or keys.get("blockname")
        if name is None or ("switchname" in keys and "blockname" in keys):
            raise NestError(f"{where}: a line without SwitchName= or BlockName=, or with both (the tree plugin's lines "
                            "are SwitchName=... Nodes=... or SwitchName=... Switches=..., the block plugin's "
                            "BlockName=... Nodes=...)")
        is_block = "blockname" in keys
        if switches and is_block != bool(blocks):
            raise NestError(f"{where}: {'BlockName' if is_block else 'SwitchName'}= after "
                            f"{'SwitchName' if is_block else 'BlockName'}= lines; a topology.conf is the tree plugin's "
                            "(SwitchName=) or the block plugin's (BlockName=), not both")
        if is_block and "switches" in keys:
            raise NestError(f"{where}: block {name} lists Switches=; a block holds nodes only (BlockName=... Nodes=...)")
        kind = "block" if is_block else "switch"
        if name in switches:
            raise NestError(f"{where}: {kind} {name} is described twice")
        switches.add(name)
        if is_block:
            index = keys.get("blockindex", "")
            blocks.append((int(index) if index.isdigit() else number, number, name))
        # A switch with Switches= is not a leaf: the Nodes= that `scontrol show topology` prints beside it are
        # the nodes below its children.
        for node in expand(keys["nodes"], key=f"{where}: Nodes") if "nodes" in keys and "switches" not in keys else []:
            if node in leaf_of:
                raise NestError(f"{where}: node {node} hangs off {'blocks' if is_block else 'switches'} {leaf_of[node]} and {name}")
            leaf_of[node] = name
        for child in expand(keys["switches"], key=f"{where}: Switches") if "switches" in keys else []:
            if child in parent:
                raise NestError(f"{where}: switch {child} hangs off switches {parent[child]} and {name}")
            parent[child] = name
    unknown = sorted(set(parent) - switches)
    if unknown:
        raise NestError(f"{source}: switch {unknown[0]} is listed under Switches= but never described with SwitchName=")
    tree = SwitchTree(parent, leaf_of, tuple(name for _, _, name in sorted(blocks)))
    for switch in parent:  # a loop would walk up forever
        seen = {switch}
        up = switch
        while up in parent:
            up = parent[up]
            if up in seen:
                raise NestError(f"{source}: switch {switch} is its own ancestor (a loop in Switches=)")
            seen.add(up)
    return tree


def allocation_topology(base: Topology, tree: SwitchTree, nodes: list[str], *, source: str) -> Topology:
    """`base`'s levels over the allocated `nodes` as the tree connects them, with the nodes in device order
    as its hosts (node i holds devices i * devices_per_node ...). Units are ordered largest first, so the devices a plan
    leaves idle (the last ones) are in the smallest units; inside a unit, nodes keep the order given."""
    missing = [n for n in nodes if n not in tree.leaf_of]
    if missing:
        raise NestError(f"cluster.nodes: node {missing[0]} is not under any {'block' if tree.blocks else 'switch'} "
                        f"of {source}")
    seen: set[str] = set()
    for n in nodes:
        if n in seen:
            raise NestError(f"cluster.nodes: node {n} is listed twice")
        seen.add(n)
    h = base.host_level
    above = len(base.levels) - 1 - h  # config levels above the host; the top one holds everything
    if tree.blocks:
        tree = grouped_blocks(tree, base)
    chains = {n: tree.chain(n) for n in nodes}

    def unit(node: str, k: int) -> str:
        """The node's unit at the k-th level above the host (k = 1: its leaf); the top level is one unit."""
        if k >= above:
            return ""
        chain = chains[node]
        return chain[min(k, len(chain)) - 1]

    levels_above = range(above, 0, -1)  # top first
    size = {(k, unit(n, k)): 0 for n in nodes for k in levels_above}
    for n in nodes:
        for k in levels_above:
            size[(k, unit(n, k))] += 1
    position = {n: i for i, n in enumerate(nodes)}
    order = sorted(nodes, key=lambda n: [(-size[(k, unit(n, k))], unit(n, k)) for k in levels_above] + [position[n]])
    children = [(lv.fan_out,) * (len(nodes) * base.devices_per_node // base.unit_size(lvl))
                for lvl, lv in enumerate(base.levels[: h + 1])]
    for k in range(1, above + 1):
        counts: list[int] = []
        below = [unit(n, k - 1) if k > 1 else n for n in order]
        here = [unit(n, k) for n in order]
        previous = None
        for i, name in enumerate(here):
            if i and below[i] == below[i - 1]:
                continue  # the same unit of the level below: counted once
            if name != previous or not counts:
                counts.append(0)
                previous = name
            counts[-1] += 1
        children.append(tuple(counts))
    # A tree shallower than the config ends at its root: drop the levels whose single unit holds one unit below.
    while len(children) > h + 1 and len(children[-1]) == 1 and len(children[-2]) == 1:
        children.pop()
    return irregular(base, tuple(children), tuple(order))


def grouped_blocks(tree: SwitchTree, base: Topology) -> SwitchTree:
    """The blocks under `base`'s levels above theirs: consecutive blocks, fan_out of them a unit of the next level
    up, those units fan_out a unit of the next, and so on below the top level (which holds everything)."""
    parent: dict[str, str] = {}
    units = list(tree.blocks)
    for level in range(base.host_level + 2, len(base.levels) - 1):
        fan_out = base.levels[level].fan_out
        groups = [f"{base.levels[level].name}#{i // fan_out}" for i in range(len(units))]  # '#' is in no SLURM name
        parent |= dict(zip(units, groups))
        units = list(dict.fromkeys(groups))
    return SwitchTree(parent, tree.leaf_of, tree.blocks)


def from_scontrol() -> SwitchTree | None:
    """The scheduler's switch tree (or blocks), from `scontrol show topology`: None where it answers neither (no
    scontrol, no controller, or no tree or block plugin)."""
    try:
        done = subprocess.run(["scontrol", "show", "topology"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or ("SwitchName=" not in done.stdout and "BlockName=" not in done.stdout):
        return None
    return parse(done.stdout, source="scontrol show topology")


def read(path: str) -> SwitchTree:
    """Parse the topology.conf at `path`; an unreadable file is one line."""
    try:
        text = open(path, encoding="utf-8").read()  # noqa: SIM115 - one read
    except OSError as err:
        raise NestError(f"cluster.topology_conf={path}: cannot read it ({err.strerror})") from None
    return parse(text, source=path)

