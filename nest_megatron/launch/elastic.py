"""`nest-megatron launch --nnodes MIN:MAX`: torchrun's elastic agent, with every node count planned before it starts.

Before anything starts, each node count MIN..MAX is planned as a fixed launch of that size would be (`prepare`)
and written to the run directory: plans/nodes<N>.json (the Plan JSON) and elastic.json (per node count: the
rewritten Megatron argv, its environment and the plan's digest and sizes). torchrun's agent (c10d rendezvous)
restarts its workers after every rendezvous (at start, when a node is lost, when one joins) with WORLD_SIZE set
for the nodes present. Each worker is `python -m nest_megatron.launch.elastic_worker RUN_DIR`: it reads the entry of
that node count and execs the training script with it, so the replan is a file read, not a search.

The workers resume from the checkpoint the previous membership saved, so the argv must --save and --load one
directory in torch_dist, and every cached plan must read what any other wrote (`check_resumable`). The global
batch is the argv's in every plan; each plan picks its micro-batch size, so the micro-batches per step
(global batch / (micro batch x DP)) change with the node count.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from nest_megatron.config.megatron_argv import scan
from nest_megatron.errors import NestError
from nest_megatron.launch.constraints import BUCKET_SPACE_SIZES, DEFAULT_CKPT_FORMAT
from nest_megatron.launch.devices import Devices
from nest_megatron.launch.elastic_worker import INDEX, WORKER_MODULE
from nest_megatron.launch.placement import host_assignments
from nest_megatron.launch.prepare import Prepared, megatron_env
from nest_megatron.model.spec import ModelSpec

# torch's agents share one TCPStore with their workers, hosted by the round's rank-0 node, but keep the first
# round's address when rank 0 moves to another node (a lost node): the workers of two nodes then read different
# stores, one of them stale, and gloo connects to a dead process. Opting out, the workers use the rendezvous
# store under a prefix per round.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# Every node count is planned on all its devices (torchrun starts a worker on each); the user's overrides,
# which follow, may say otherwise, and `entry` then refuses a plan that leaves devices idle.
ELASTIC_OVERRIDES = ("solver.allow_idle=false",)


def node_range(text: str | None) -> tuple[int, int] | None:
    """`--nnodes MIN:MAX` -> (MIN, MAX); None for a fixed count (N, or N:N)."""
    if text is None or ":" not in str(text):
        return None
    low, _, high = str(text).partition(":")
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise NestError(f"--nnodes {text}: give MIN:MAX with 1 <= MIN <= MAX, e.g. 2:4")
    return None if low == high else (int(low), int(high))


# Keys that name an allocation's nodes: an elastic job plans by node count, whichever nodes the rendezvous brings.
NODE_KEYS = ("cluster.nodes", "cluster.failed_nodes", "cluster.topology_conf")


def check_node_keys(overrides: list[str], nnodes: str) -> None:
    """One line for a key that names nodes: the rendezvous says how many nodes are present, not which."""
    named = next((o for o in overrides if o.partition("=")[0] in NODE_KEYS), None)
    if named is not None:
        raise NestError(f"--nnodes {nnodes} with {named}: an elastic job is planned by node count, whichever nodes the "
                        "rendezvous brings (a lost node is replanned without naming it); drop it")


def check_resume_argv(script_args: list[str], nnodes: str) -> None:
    """An elastic job continues from its last checkpoint after each rendezvous: the argv saves one periodically
    and loads it back, in the format Megatron reshards across TP / PP / DP (torch_dist)."""
    s = scan(script_args)
    fmt = s.get("--ckpt-format", DEFAULT_CKPT_FORMAT)
    if fmt != "torch_dist":
        raise NestError(f"--nnodes {nnodes} with --ckpt-format {fmt}: an elastic job resumes under another plan after "
                        "each rendezvous, and only torch_dist is resharded across TP / PP / DP; give --ckpt-format torch_dist")
    save, load = passed(script_args, "--save"), passed(script_args, "--load")
    if not save or not passed(script_args, "--save-interval") or load != save:
        raise NestError(f"--nnodes {nnodes}: an elastic job resumes from its last checkpoint after each rendezvous; "
                        "give --save DIR --load DIR (the same directory) and --save-interval N")


def passed(argv: list[str], flag: str) -> str | None:
    """The last value of a flag the planner does not read (it passes through: --save, --load, ...)."""
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.partition("=")[2]
    return value


@dataclass(frozen=True)
class Entry:
    """What a worker needs for one node count."""

    nodes: int
    digest: str
    parallel: dict
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    zero_stage: int
    vocab_size: int  # the tokenizer's, before Megatron pads it
    vocab_divisible_by: int  # --make-vocab-size-divisible-by
    padded_vocab: int
    world_size: int
    num_devices: int
    argv: list[str]  # the training script's rewritten arguments
    env: dict  # added to the worker's environment; None: removed
    cuda_visible_devices: dict  # torchrun's node rank (GROUP_RANK) -> CUDA_VISIBLE_DEVICES

    def summary(self) -> str:
        p = self.parallel
        return (f"{self.nodes} node(s): tp={p['tp']} pp={p['pp']} dp={p['dp']} cp={p['cp']} ep={p['ep']} vpp={p['vpp']} "
                f"mbs={self.micro_batch_size} x {self.num_microbatches} micro-batches = global batch "
                f"{self.global_batch_size}, zero={self.zero_stage}, plan {self.digest}")


def entry(prepared: Prepared, nodes: int) -> Entry:
    plan = prepared.plan
    if plan.idle_devices:
        raise NestError(f"the plan for {nodes} node(s) leaves {plan.idle_devices} device(s) idle, which an elastic "
                        "launch cannot (torchrun starts a worker on every device of every node present)")
    hosts = [f"node{i}" for i in range(nodes)]
    visible = {a.node_rank: ",".join(map(str, a.cuda_visible_devices)) for a in host_assignments(plan, hosts)}
    return Entry(nodes=nodes, digest=plan.digest, parallel=dict(plan.parallel), micro_batch_size=plan.micro_batch_size,
                 global_batch_size=plan.global_batch_size, num_microbatches=plan.num_microbatches,
                 zero_stage=plan.zero_stage, vocab_size=prepared.loaded.config.model.vocab_size,
                 vocab_divisible_by=prepared.loaded.config.model.make_vocab_size_divisible_by,
                 padded_vocab=ModelSpec(prepared.loaded.config.model).padded_vocab(plan.parallel["tp"]),
                 world_size=plan.world_size, num_devices=plan.num_devices, argv=list(prepared.script_args),
                 env=megatron_env(plan), cuda_visible_devices=visible)


def check_resumable(entries: list[Entry], script_args: list[str]) -> None:
    """Every plan must load the checkpoint any other plan wrote (launch/constraints.py has already held the
    optimizer family and, for the bucket-space distributed optimizer, the sizes it cannot reshard, on each
    plan alone); one line naming the first pair that cannot."""
    s = scan(script_args)
    bucket_space = s.has("--use-distributed-optimizer") and not s.present("--dist-ckpt-optim-fully-reshardable")
    first = entries[0]
    for other in entries[1:]:
        pair = f"the plans for {first.nodes} and {other.nodes} node(s)"
        if other.padded_vocab != first.padded_vocab:
            raise NestError(f"{pair} pad the vocabulary to {first.padded_vocab} and {other.padded_vocab} rows "
                            f"(TP {first.parallel['tp']} vs {other.parallel['tp']}), so neither loads the other's "
                            f"checkpoint: {_vocab_advice(first, [e.parallel['tp'] for e in entries])}")
        if other.zero_stage != first.zero_stage:
            raise NestError(f"{pair} use ZeRO {first.zero_stage} and {other.zero_stage}, whose optimizer states "
                            "do not load each other; pin zero")
        if bucket_space:
            changed = [k for k in BUCKET_SPACE_SIZES if other.parallel.get(k) != first.parallel.get(k)]
            if changed:
                raise NestError(f"{pair} differ in {', '.join(changed)}, which the distributed optimizer's bucket-space "
                                "checkpoint cannot reshard: add --dist-ckpt-optim-fully-reshardable, or pin them")


def _vocab_advice(first: Entry, tps: list[int]) -> str:
    """The largest power-of-two --make-vocab-size-divisible-by m, no coarser than the one given (m is the per-rank
    alignment Megatron pads for), under which every TP pads the vocabulary to the same rows: Megatron pads to a
    multiple of m x TP (megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding)."""
    vocab = first.vocab_size
    for m in (2 ** k for k in range(first.vocab_divisible_by.bit_length() - 1, -1, -1)):
        if len({math.ceil(vocab / (m * tp)) * m * tp for tp in tps}) == 1:
            return f"give --make-vocab-size-divisible-by {m} (every TP of {sorted(set(tps))} then pads {vocab} alike), or pin tp"
    return "no --make-vocab-size-divisible-by pads it alike for every TP: pin tp"  # e.g. 50001 at TP 1 and 2


def plan_sizes(plan_one, low: int, high: int, nnodes: str) -> list[tuple[Prepared, Entry]]:
    """`plan_one(n)` -> Prepared for each n in low..high; a node count that cannot be planned is one line."""
    out = []
    for nodes in range(low, high + 1):
        try:
            prepared = plan_one(nodes)
            out.append((prepared, entry(prepared, nodes)))
        except NestError as err:
            every = " on all their devices" if "no launchable configuration" in str(err) else ""
            raise type(err)(f"--nnodes {nnodes}: {nodes} node(s) cannot be planned{every}: {err}") from None
    return out


def sized(devices: Devices, nodes: int) -> Devices:
    return replace(devices, num_nodes=nodes, node_rank=None, hosts=())


def rdzv_id(entries: list[Entry], script: str) -> str:
    """The same on every node that planned the same (as the plan digest): nodes whose plans differ do not join."""
    text = json.dumps([script, [e.digest for e in entries], [e.argv for e in entries]])
    return "nest-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def write_cache(run_dir: Path, sized_plans: list[tuple[Prepared, Entry]], script: str) -> Path:
    """plans/nodes<N>.json and elastic.json under run_dir, each written whole (a rename) so that a worker never
    reads half a file."""
    (run_dir / "plans").mkdir(parents=True, exist_ok=True)
    for prepared, e in sized_plans:
        _write(run_dir / "plans" / f"nodes{e.nodes}.json", prepared.plan.to_json())
    index = {"script": script, "python": sys.executable,
             "sizes": {str(e.world_size): {**e.__dict__, "plan": f"plans/nodes{e.nodes}.json"} for _, e in sized_plans}}
    _write(run_dir / INDEX, json.dumps(index, indent=1))
    return run_dir / INDEX


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def torchrun_argv(*, nnodes: str, per_node: int, endpoint: str, run_id: str, max_restarts: int, run_dir: Path,
                  rdzv_conf: str | None) -> list[str]:
    """torchrun's elastic agent: the c10d rendezvous (node ranks in join order) and this module as the worker."""
    flags = ["torchrun", "--nnodes", nnodes, "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", str(max_restarts)]
    if rdzv_conf:
        flags += ["--rdzv-conf", rdzv_conf]
    return flags + ["-m", WORKER_MODULE, str(run_dir)]
