"""How many devices and nodes a launch has, from torchrun's flags or from a SLURM allocation.

torchrun's flags win where given; otherwise SLURM's variables (SLURM_JOB_NODELIST, SLURM_NNODES,
SLURM_NODEID, SLURM_GPUS_ON_NODE) describe the job. What is missing or inconsistent is one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from nest_megatron.errors import NestError
from nest_megatron.hardware.hostlist import expand

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Devices:
    """The machines of one launch."""

    num_nodes: int
    per_node: int  # devices (processes) per node
    node_rank: int | None = None  # this node's index; None when not known (a dry run on a laptop)
    hosts: tuple[str, ...] = field(default_factory=tuple)  # node host names, in SLURM's order
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    source: str = "torchrun flags"

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.per_node


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list, expanded: 'n[1-3,5],gpu07' -> ['n1', 'n2', 'n3', 'n5', 'gpu07'].

    Zero padding is kept ('n[08-10]' -> n08 n09 n10); several bracket groups in one name multiply.
    """
    return expand(text.strip(), key="SLURM_JOB_NODELIST")


def _int(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise NestError(f"{name}={value}: expected an integer") from None
    if number < 0:
        raise NestError(f"{name}={value}: must not be negative")
    return number


def _nnodes(value: str | int) -> int:
    text = str(value)
    if ":" in text:
        low, high = text.split(":", 1)
        if low != high:
            raise NestError(f"--nnodes {text}: nest-torchrun plans one node count; for an elastic range, which plans "
                            f"every count and replans at each rendezvous, use nest-megatron launch --nnodes {text}")
        text = low
    nodes = _int("--nnodes", text)
    if nodes < 1:
        raise NestError(f"--nnodes {text}: must be at least 1")
    return nodes


def _per_node(value: str | int) -> int:
    text = str(value)
    if text in ("gpu", "auto", "cuda"):
        import torch  # only here: counting local GPUs needs it

        count = torch.cuda.device_count()
        if not count:
            raise NestError(f"--nproc-per-node {text}: this machine has no GPU; give a number")
        return count
    if text == "cpu":
        return os.cpu_count() or 1
    per = _int("--nproc-per-node", text)
    if per < 1:
        raise NestError(f"--nproc-per-node {text}: must be at least 1")
    return per


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        return text, DEFAULT_MASTER_PORT
    return host, _int("--rdzv-endpoint port", port)


def resolve(*, nnodes=None, nproc_per_node=None, node_rank=None, master_addr=None, master_port=None,
            rdzv_endpoint=None, standalone: bool = False, env: dict[str, str] | None = None) -> Devices:
    """The launch's devices: torchrun's flags first, SLURM's variables for what they leave open."""
    env = dict(os.environ) if env is None else env
    slurm = _slurm(env)
    if nproc_per_node is None and slurm is None:
        raise NestError("device count unknown: give --nproc-per-node (and --nnodes), or run inside a SLURM "
                        "allocation (srun) with SLURM_GPUS_ON_NODE")
    if standalone and nnodes is not None and _nnodes(nnodes) != 1:
        raise NestError(f"--standalone with --nnodes {nnodes}: standalone is one node")
    nodes = _nnodes(nnodes) if nnodes is not None else (1 if standalone or slurm is None else slurm.num_nodes)
    if slurm is not None and nodes != slurm.num_nodes:
        raise NestError(f"--nnodes {nodes}, but the SLURM allocation has SLURM_NNODES={slurm.num_nodes}")
    if nproc_per_node is not None:
        per = _per_node(nproc_per_node)
    elif slurm.per_node:
        per = slurm.per_node
    else:
        raise NestError("devices per node unknown: SLURM_GPUS_ON_NODE is not set; give --nproc-per-node")
    rank = _int("--node-rank", node_rank) if node_rank is not None else (slurm.node_rank if slurm else None)
    if rank is None and nodes == 1:
        rank = 0
    if rank is not None and rank >= nodes:
        raise NestError(f"node rank {rank}: must be below the node count {nodes}")
    addr, port = master_addr, _int("--master-port", master_port) if master_port is not None else None
    if rdzv_endpoint:
        if master_addr:
            raise NestError("--rdzv-endpoint and --master-addr: give one")
        addr, port = _endpoint(rdzv_endpoint)
    if addr is None and slurm is not None:
        addr = slurm.hosts[0]  # the first host of the allocation: the same on every node
    if port is None:
        port = slurm.master_port if slurm is not None else DEFAULT_MASTER_PORT
    return Devices(num_nodes=nodes, per_node=per, node_rank=rank, hosts=slurm.hosts if slurm else (),
                   master_addr=addr, master_port=port, source="SLURM" if slurm and nnodes is None else "torchrun flags")


def _slurm(env: dict[str, str]) -> Devices | None:
    """The allocation SLURM describes, or None outside SLURM (no SLURM_JOB_NODELIST / SLURM_NNODES). Inside an
    srun step, the step's nodes (SLURM_STEP_NODELIST, whose SLURM_NODEID it counts): `srun --exclude` of a failed
    node runs on fewer nodes than the job has."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    nnodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    step = env.get("SLURM_STEP_NODELIST")
    if step and str(len(expand_nodelist(step))) == (env.get("SLURM_STEP_NUM_NODES") or nnodes):
        nodelist = step
    if nodelist is None and nnodes is None:
        return None
    if nodelist is None:
        raise NestError(f"SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST is not set")
    hosts = tuple(expand_nodelist(nodelist))
    if nnodes is not None and _int("SLURM_NNODES", nnodes) != len(hosts):
        raise NestError(f"SLURM_NNODES={nnodes}, but SLURM_JOB_NODELIST={nodelist} names {len(hosts)} hosts")
    if len(set(hosts)) != len(hosts):
        raise NestError(f"SLURM_JOB_NODELIST={nodelist}: a host is named twice")
    node_id = env.get("SLURM_NODEID")
    rank = _int("SLURM_NODEID", node_id) if node_id is not None else None
    if rank is not None and rank >= len(hosts):
        raise NestError(f"SLURM_NODEID={rank}: must be below the {len(hosts)} nodes of SLURM_JOB_NODELIST")
    gpus = env.get("SLURM_GPUS_ON_NODE")
    per = _int("SLURM_GPUS_ON_NODE", gpus) if gpus else 0
    job = env.get("SLURM_JOB_ID")
    # One port per job, so that two jobs sharing a node do not collide; the same on every node of the job.
    port = 20000 + _int("SLURM_JOB_ID", job) % 20000 if job else DEFAULT_MASTER_PORT
    return Devices(num_nodes=len(hosts), per_node=per, node_rank=rank, hosts=hosts, master_addr=hosts[0],
                   master_port=port, source="SLURM")
