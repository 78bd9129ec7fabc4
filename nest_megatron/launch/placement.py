"""Make a plan's rank -> device map real: each host's torchrun --node-rank and CUDA_VISIBLE_DEVICES.

torchrun numbers processes `global rank = node_rank * nproc_per_node + local_rank`, and local rank i
of a host uses the i-th GPU listed in CUDA_VISIBLE_DEVICES. The plan places rank r on physical
device `plan.rank_to_device[r] = host_index * devices_per_host + local_gpu`, hosts in cluster order.
So a host whose devices hold ranks k*n .. k*n + n - 1 gets `--node-rank k` and lists, in local-rank
order, the GPUs those ranks were planned on. Megatron's rank order itself (which dimension is
fastest) travels in the plan's argv (`--use-tp-pp-dp-mapping`, emit/megatron.py), not here.

Only torchrun's static rendezvous (`--master-addr/--master-port/--node-rank`, the default when no
`--rdzv-backend` is given) honours --node-rank; the c10d backend numbers nodes in join order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nest_megatron.errors import NestError
from nest_megatron.plan import Plan


@dataclass(frozen=True)
class HostAssignment:
    """What one host runs: all its torchrun agent needs to put the plan's ranks on its GPUs."""

    host: str
    node_rank: int | None  # torchrun --node-rank; None: the plan leaves every device of this host idle
    nnodes: int  # torchrun --nnodes (hosts that run ranks)
    nproc_per_node: int  # torchrun --nproc-per-node
    cuda_visible_devices: tuple[int, ...]  # local GPU ids, in local-rank order; () when idle

    @property
    def idle(self) -> bool:
        return self.node_rank is None

    def env(self) -> dict[str, str]:
        """The environment the host's torchrun agent needs (nothing for an idle host)."""
        return {} if self.idle else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.cuda_visible_devices))}


def host_assignments(plan: Plan, hosts: Sequence[str]) -> list[HostAssignment]:
    """One HostAssignment per host of `hosts` (the physical nodes in cluster order, as the plan
    numbers them), for `plan.rank_to_device` on `plan.num_devices` devices spread evenly over them.

    Raises NestError (one line) for a map torchrun cannot realise."""
    return assignments_for_map(plan.rank_to_device, plan.num_devices, hosts)


def assignments_for_map(rank_to_device: Sequence[int], num_devices: int, hosts: Sequence[str]) -> list[HostAssignment]:
    """host_assignments for a bare rank -> device map on `num_devices` devices over `hosts`."""
    hosts = list(hosts)
    if not hosts:
        raise NestError("no hosts to place the ranks on: give at least one")
    if len(set(hosts)) != len(hosts):
        raise NestError(f"hosts {hosts} name a host twice: each physical node once, in cluster order")
    if num_devices % len(hosts):
        raise NestError(f"{num_devices} devices do not spread evenly over {len(hosts)} hosts: give "
                        f"a number of hosts that divides {num_devices}")
    per_host = num_devices // len(hosts)
    devices = [int(d) for d in rank_to_device]
    if not devices:
        raise NestError("the plan's rank_to_device is empty: a plan has at least one rank")
    if len(set(devices)) != len(devices) or not all(0 <= d < num_devices for d in devices):
        raise NestError(f"rank_to_device must give each rank its own device in 0..{num_devices - 1}, got {devices}")

    ranks_on = [[] for _ in hosts]  # host index -> its ranks, ascending
    for rank, device in enumerate(devices):
        ranks_on[device // per_host].append(rank)
    counts = sorted({len(r) for r in ranks_on if r})
    if len(counts) > 1:
        raise NestError(f"torchrun starts the same number of processes on every node, but the plan puts {counts} "
                        f"ranks on different hosts (rank_to_device {devices})")
    nproc = counts[0]
    nnodes = len(devices) // nproc
    out = []
    for host, ranks in zip(hosts, ranks_on):
        if not ranks:
            out.append(HostAssignment(host, None, nnodes, nproc, ()))
            continue
        node_rank = ranks[0] // nproc
        block = list(range(node_rank * nproc, (node_rank + 1) * nproc))
        if ranks != block:
            raise NestError(
                f"torchrun cannot realise this placement: host {host} holds ranks {ranks}, but a torchrun node "
                f"holds {nproc} consecutive ranks starting at a multiple of {nproc} (rank_to_device {devices})")
        local_gpus = tuple(devices[r] % per_host for r in ranks)
        out.append(HostAssignment(host, node_rank, nnodes, nproc, local_gpus))
    return out


def hosts_in_device_order(plan: Plan) -> list[str]:
    """`plan.hosts` (node-rank order, idle hosts last) back in device order, the order `host_assignments`
    takes: node rank k's host holds the device block of rank k * n; the idle hosts fill the blocks left."""
    per = plan.num_devices // len(plan.hosts)
    order: list[str | None] = [None] * len(plan.hosts)
    running = len(plan.rank_to_device) // per
    for k in range(running):
        order[plan.rank_to_device[k * per] // per] = plan.hosts[k]
    idle = iter(plan.hosts[running:])
    return [host if host is not None else next(idle) for host in order]


def master_host(assignments: Sequence[HostAssignment]) -> str:
    """The host of node rank 0: global rank 0 and the static rendezvous store run there
    (torchrun --master-addr)."""
    return next(a.host for a in assignments if a.node_rank == 0)
