"""What `nest-megatron profile` measures, and measuring it.

The sub-graph strategies are the ones the solver searches (`solver.space.candidates`, reduced to
their TP, SP, CP, EP, expert-TP and micro-batch). For each, and each layer kind of the model:

- ops: every GEMM shape of the layer and of the output layer, the attention kernel and the
  memory-bound elementwise traffic, on one device (the compute model is fitted from these);
- layers: the real megatron-core layer (dense, MoE, embedding, output with its cross entropy),
  forward and backward. A group that fits on the local devices (`profile.local_devices`) runs as
  real processes under torchrun (NCCL on GPUs, gloo on a CPU), its collectives included; a wider
  group is timed as one rank's shard on a fake process group, and the collectives the cost model
  charges are recorded beside it (`modelled_comm_s`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from nest_megatron.config.schema import ModelConfig, PlanChoice, SolverConfig
from nest_megatron.cost.evaluate import groups_and_network
from nest_megatron.cost.layer import elementwise_bytes, layer_time
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.profile.cache import Entry
from nest_megatron.profile.timing import device_name, local_device, median_seconds, versions
from nest_megatron.solver.space import candidates

DTYPE = "bf16"
SPEC = "local"  # megatron-core's local layer spec (unfused attention), as scripts/pretrain_gpt.py trains


class Skip(Exception):
    """A layer this machine cannot time under a strategy; the reason is reported, the ops still count."""


@dataclass(frozen=True)
class Strategy:
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 1
    mbs: int = 1


@dataclass
class Task:
    kind: str  # gemm | attention | memory | dense | moe | embedding | output
    shape: dict
    strategy: dict = field(default_factory=dict)
    work: dict = field(default_factory=dict)
    processes: int = 1  # > 1: timed across that many real processes under torchrun
    modelled_comm_s: float = 0.0
    model: dict | None = None  # the ModelConfig a layer is built from

    @property
    def key(self) -> str:
        return json.dumps([self.kind, self.shape, self.strategy], sort_keys=True)

    @property
    def is_layer(self) -> bool:
        return self.model is not None


def strategies(problem: Problem, solver: SolverConfig, pins: PlanChoice, *,
               micro_batch_size: int | None) -> dict[Strategy, ParallelConfig]:
    """The distinct sub-graph strategies among the configurations the solver searches, each with
    one configuration that uses it (its groups' placement prices the modelled collectives).

    ZeRO, recompute, virtual stages and rank order do not change a layer's sub-graph strategy, so
    one value of each is enough to enumerate them."""
    narrow = dataclasses.replace(solver, zero_stages=solver.zero_stages[:1], recompute=solver.recompute[:1],
                                 recompute_num_layers=solver.recompute_num_layers[:1], max_virtual_stages=1,
                                 rank_orders=solver.rank_orders[:1])
    found: dict[Strategy, ParallelConfig] = {}
    for cfg in candidates(problem, narrow, pins, micro_batch_size=micro_batch_size):
        found.setdefault(Strategy(cfg.tp, cfg.sp, cfg.cp, cfg.ep, cfg.etp, cfg.mbs), cfg)
    if not found:
        raise NestError(f"no configuration of {problem.model.cfg.name} is valid on {problem.num_devices} devices "
                        "within the plan.* pins: nothing to profile")
    return dict(sorted(found.items(), key=lambda kv: dataclasses.astuple(kv[0])))


def layer_shape(cfg: ModelConfig) -> dict:
    """What a layer's time depends on: the model's shape without its name and depth, and the spec."""
    shape = {k: v for k, v in asdict(cfg).items() if k not in ("name", "num_layers")}
    return {**shape, "spec": SPEC}


def ran_config(cfg: ModelConfig) -> ModelConfig:
    """The model as the local spec runs it: megatron-core's unfused attention."""
    return dataclasses.replace(cfg, attention_backend="unfused")


def layer_work(cfg: ModelConfig, s: Strategy, *, kind: LayerKind) -> dict:
    """The GEMMs, attention FLOPs and memory-bound bytes the cost model assigns one layer pass."""
    spec = ModelSpec(ran_config(cfg))
    tokens = s.mbs * cfg.seq_length // s.cp
    parallel = ParallelConfig(tp=s.tp, sp=s.sp, cp=s.cp, ep=s.ep, etp=s.etp, mbs=s.mbs)
    gemms = spec.layer_gemms(tokens=tokens, tp=s.tp, sp=s.sp, ep=s.ep, etp=s.etp, kind=kind)
    return {
        "gemms": [[g.m, g.n, g.k, g.count] for g in gemms],
        "attention_flops": spec.attention_flops(micro_batch=s.mbs, tp=s.tp, cp=s.cp, kind=kind),
        "head_dim": spec.attention_head_dim(kind),
        "memory_bytes": elementwise_bytes(spec, tokens=tokens, cfg=parallel, kind=kind),
    }


def plan_tasks(problem: Problem, found: dict[Strategy, ParallelConfig], *, local_devices: int, layers: bool) -> list[Task]:
    """Every distinct op and layer measurement for `found`, ops first."""
    model = problem.model
    cfg, h = model.cfg, model.h
    ops: dict[str, Task] = {}
    layer_tasks: dict[str, Task] = {}

    def add(into, task):
        into.setdefault(task.key, task)

    for s, parallel in found.items():
        tokens = s.mbs * cfg.seq_length // s.cp
        vocab = model.padded_vocab(s.tp)
        for kind in model.kinds:
            for g in model.layer_gemms(tokens=tokens, tp=s.tp, sp=s.sp, ep=s.ep, etp=s.etp, kind=kind):  # one of a group
                m = max(1, round(g.m))  # routed rows are an expectation (tokens x topk spread over experts)
                add(ops, Task("gemm", {"m": m, "n": g.n, "k": g.k}, work={"flops": 2.0 * m * g.n * g.k}))
        add(ops, Task("gemm", {"m": tokens, "n": vocab // s.tp, "k": h}, work={"flops": 2.0 * tokens * vocab // s.tp * h}))
        if s.cp == 1:  # the kernel's efficiency; CP's shorter query blocks are priced from it
            add(ops, Task("attention", {"b": s.mbs, "heads": model.heads // s.tp, "s": cfg.seq_length,
                                        "d": model.head_dim, "causal": cfg.family == "gpt"},
                          work={"flops": model.attention_flops(micro_batch=s.mbs, tp=s.tp, cp=1)}))
        tokens_sp = tokens // s.tp if s.sp else tokens
        for numel in (tokens_sp * h, tokens * cfg.ffn_hidden_size // s.tp):
            add(ops, Task("memory", {"bytes": 3 * 2 * numel}, work={"bytes": 3 * 2 * numel}))
        if not layers:
            continue
        strategy = asdict(s)
        for kind in model.kinds:
            if kind.mixer != "attention":  # whole layers are timed for standard attention (megatron_layers.py)
                continue
            world = math.lcm(s.tp, s.ep * s.etp)
            task = Task(kind.label, layer_shape(cfg), strategy, layer_work(cfg, s, kind=kind),
                        processes=world if 1 < world <= local_devices else 1, model=asdict(cfg))
            if world > 1:
                spans, net = groups_and_network(problem, parallel, None)
                lt = layer_time(model, cfg=parallel, kind=kind, spans=spans, net=net, compute=problem.compute_model)
                task.modelled_comm_s = lt.fwd_comm + lt.bwd_comm
            add(layer_tasks, task)
        head = {"tp": s.tp, "sp": s.sp, "mbs": s.mbs}
        for kind in ("embedding", "output"):
            add(layer_tasks, Task(kind, {**layer_shape(cfg), "vocab": vocab}, head,
                                  processes=s.tp if 1 < s.tp <= local_devices else 1, model=asdict(cfg)))
    return list(ops.values()) + list(layer_tasks.values())


# --- measuring -------------------------------------------------------------------------------
def time_op(task: Task, device: torch.device, *, warmup: int, repeats: int) -> float:
    dtype, shape = torch.bfloat16, task.shape
    if task.kind == "gemm":
        a = torch.randn(shape["m"], shape["k"], device=device, dtype=dtype)
        b = torch.randn(shape["k"], shape["n"], device=device, dtype=dtype)
        c = torch.empty(shape["m"], shape["n"], device=device, dtype=dtype)
        return median_seconds(lambda: torch.mm(a, b, out=c), device=device, warmup=warmup, repeats=repeats)
    if task.kind == "attention":
        q, k, v = (torch.randn(shape["b"], shape["heads"], shape["s"], shape["d"], device=device, dtype=dtype)
                   for _ in range(3))
        return median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=shape["causal"]),
                              device=device, warmup=warmup, repeats=repeats)
    numel = shape["bytes"] // 6  # two bf16 inputs read, one written
    x, y, z = (torch.randn(numel, device=device, dtype=dtype) for _ in range(3))
    return median_seconds(lambda: torch.add(x, y, out=z), device=device, warmup=warmup, repeats=repeats)


def time_layer_task(task: Task, device: torch.device, *, warmup: int, repeats: int, before=None,
                    fake: bool) -> tuple[dict, float, float]:
    """(strategy as run, forward + backward s, forward s) of a layer task on this rank; `fake`:
    alone on a fake process group of the strategy's width. Falls back to no sequence parallel
    where the layer refuses it, and says so in the strategy it returns."""
    from nest_megatron.profile import megatron_layers as ml

    cfg = ModelConfig(**task.model)
    strategy = dict(task.strategy)
    tp, ep, etp = strategy["tp"], strategy.get("ep", 1), strategy.get("etp", 1)
    if strategy.get("cp", 1) > 1:
        raise Skip("context parallel needs Transformer Engine's attention; the local spec runs cp = 1")
    if fake and task.kind == "moe" and ep > 1:
        raise Skip("expert parallel wider than the local devices: routing on a fake process group is not real")
    world = ml.group_world(tp, ep, etp)

    def measure(sp: bool):
        kwargs = dict(tp=tp, sp=sp, ep=ep, etp=etp, mbs=strategy["mbs"], vocab=task.shape.get("vocab", 0),
                      device=device, warmup=warmup, repeats=repeats, before=before)
        if fake:
            with ml.fake_group(world, tp=tp, ep=ep, etp=etp):
                return ml.time_layer(task.kind, cfg, **kwargs)
        ml.parallel_state_for(tp=tp, ep=ep, etp=etp)
        return ml.time_layer(task.kind, cfg, **kwargs)

    def refused(err: Exception) -> Skip:
        line = str(err).splitlines()[0] if str(err) else type(err).__name__
        return Skip(f"megatron-core refuses it here: {line}")

    try:
        both, fwd = measure(strategy["sp"])
    except (AssertionError, ValueError) as err:
        if not (strategy["sp"] and "sequence parallel" in str(err).lower()):
            raise refused(err) from None
        strategy["sp"] = False
        try:
            both, fwd = measure(False)
        except (AssertionError, ValueError) as again:
            raise refused(again) from None
    return strategy, both, fwd


def entry_for(task: Task, *, device: str, accelerator: str, seconds: float, fwd_s: float | None = None,
              strategy: dict | None = None, includes_comm: bool = False) -> Entry:
    work = task.work
    if task.kind in ("dense", "moe") and strategy is not None and strategy != task.strategy:
        work = layer_work(ModelConfig(**task.model), Strategy(**strategy), kind=LayerKind.from_label(task.kind))
    return Entry(device=device, accelerator=accelerator, dtype=DTYPE, kind=task.kind, shape=task.shape,
                 strategy=strategy if strategy is not None else task.strategy, seconds=seconds, fwd_s=fwd_s,
                 includes_comm=includes_comm, modelled_comm_s=task.modelled_comm_s,
                 work=work, versions=versions())


def run_tasks(tasks: list[Task], *, accelerator: str, warmup: int, repeats: int,
              progress: Callable[[Task, str | None], None]) -> list[Entry]:
    """Measure every task; `progress(task, skipped_reason)` after each. Ops and single-process
    layers run here; layers of wider groups run under torchrun, one launch per group size."""
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    entries = []
    name = device_name(device)
    groups: dict[int, list[Task]] = {}
    for task in tasks:
        if task.processes > 1:
            groups.setdefault(task.processes, []).append(task)
            continue
        if not task.is_layer:
            entries.append(entry_for(task, device=name, accelerator=accelerator,
                                     seconds=time_op(task, device, warmup=warmup, repeats=repeats)))
            progress(task, None)
            continue
        _prepare_megatron(device)
        try:
            strategy, both, fwd = time_layer_task(task, device, warmup=warmup, repeats=repeats, fake=True)
        except Skip as why:
            progress(task, str(why))
            continue
        entries.append(entry_for(task, device=name, accelerator=accelerator, seconds=both, fwd_s=fwd, strategy=strategy))
        progress(task, None)
    for processes, group in groups.items():
        for task, result in zip(group, _run_under_torchrun(group, processes, warmup=warmup, repeats=repeats)):
            if "skipped" in result:
                progress(task, result["skipped"])
                continue
            entries.append(entry_for(task, device=name, accelerator=accelerator, seconds=result["seconds"],
                                     fwd_s=result["fwd_s"], strategy=result["strategy"], includes_comm=True))
            progress(task, None)
    return entries


def _prepare_megatron(device: torch.device) -> None:
    if device.type == "cpu":
        from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron

        prepare_cpu_megatron()


def _run_under_torchrun(tasks: list[Task], processes: int, *, warmup: int, repeats: int) -> list[dict]:
    """Time `tasks` across `processes` real local processes (nest_megatron.profile.worker)."""
    with tempfile.TemporaryDirectory(prefix="nest-profile-") as tmp:
        tasks_path, out_path = Path(tmp) / "tasks.json", Path(tmp) / "results.json"
        tasks_path.write_text(json.dumps([asdict(t) for t in tasks]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                   "-m", "nest_megatron.profile.worker", str(tasks_path), str(out_path), str(warmup), str(repeats)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0 or not out_path.exists():
            lines = (done.stderr + done.stdout).strip().splitlines()
            errors = [line for line in lines if "Error" in line] or lines[-1:] or ["no output"]
            raise NestError(f"profiling {len(tasks)} layers on {processes} local processes failed: {errors[-1].strip()}")
        return json.loads(out_path.read_text())
