"""The Plan: what to launch and what it is predicted to do, with a versioned JSON form."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from nest_megatron.calibration.band import overlaps
from nest_megatron.cost.evaluate import Estimate
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.tables import chunk_split
from nest_megatron.emit.megatron import ZERO_FLAGS, model_args, parallel_args, recompute_settings
from nest_megatron.hardware.accelerator import GIB
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.layout import ACCOUNT_FIELDS, EVEN, FORM_FIELDS, simplest_form

SCHEMA_VERSION = 1
# What every node of a job must agree on to build the same Megatron: sizes, batches, memory options, layer
# split, rank placement and the flags. Not the predictions, the search statistics or the labels.
DIGEST_FIELDS = ("num_devices", "parallel", "micro_batch_size", "global_batch_size", "zero_stage", "recompute",
                 "layers_per_stage", "rank_order", "rank_to_device", "megatron_args")


@dataclass
class Plan:
    model: str
    cluster: str
    accelerator: str
    num_devices: int
    idle_devices: int
    # tp, pp, dp, cp, ep, etp, vpp, sp, cp_comm_type, moe_a2a_overlap, distributed_optimizer_instances,
    # cpu_offloading_num_layers, microbatch_group_size_per_vp_stage
    parallel: dict
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    zero_stage: int
    zero_flags: list[str]
    recompute: dict  # granularity, method, num_layers
    layers_per_stage: list[int]
    rank_order: str
    rank_to_device: list[int]
    group_levels: dict  # group kind -> name of the highest network level it crosses
    predicted: dict
    megatron_args: list[str]
    overrides: list[str] = field(default_factory=list)  # the Hydra overrides that rebuild this problem
    search: dict = field(default_factory=lambda: {"solver": "evaluate", "time_s": 0.0, "configs_evaluated": 1})
    # each: its row of the table (tp, ..., step_time_s, fits), `plan` (choice_keys: evaluate with them scores it
    # again), its `megatron_args` and `layers_per_stage`; plan.pick=K launches the K-th that fits
    runners_up: list[dict] = field(default_factory=list)
    choice: dict = field(default_factory=dict)  # choice_keys of the plan itself; {} in plans written before them
    hosts: list[str] = field(default_factory=list)  # the allocation's nodes in node-rank order, idle ones last; [] unnamed
    failed_hosts: list[str] = field(default_factory=list)  # the allocation's nodes that are down (cluster.failed_nodes)
    # The calibration that priced it (calibration/profile.py Calibration.to_plan): its constants, its cross-validated
    # errors and the band of the predicted step time; {} in plans written before calibrations
    calibration: dict = field(default_factory=dict)
    # The vocabulary it priced (vocabulary()): the tokenizer's entries, the embedding's rows its argv sets
    # (--padded-vocab-size); {} in plans written before it
    vocabulary: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        """Ranks the plan runs: tp * cp * pp * dp (the rest of num_devices is idle)."""
        p = self.parallel
        return p["tp"] * p["cp"] * p["pp"] * p["dp"]

    @property
    def digest(self) -> str:
        """12 hex digits of SHA-256 over DIGEST_FIELDS (canonical JSON): equal on every node that plans the same."""
        agreed = {name: getattr(self, name) for name in DIGEST_FIELDS}
        canonical = json.dumps(agreed, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"plan schema_version={data.get('schema_version')}: this version reads {SCHEMA_VERSION}")
        return cls(**data)


def predicted(est: Estimate) -> dict:
    host = {"host_memory_gib": est.host_memory / GIB, "host_capacity_gib": est.host_capacity / GIB} if est.host_memory else {}
    return {
        "step_time_s": est.step_time,
        "tokens_per_s": est.tokens_per_s,
        "tflops_per_gpu": est.tflops_per_gpu,
        "mfu": est.mfu,
        "peak_memory_gib": est.peak_memory / GIB,
        "capacity_gib": est.capacity / GIB,
        **host,  # with offloaded activations: their pinned host memory per device, and the host's
        "memory_per_stage_gib": [m.total / GIB for m in est.memory],
        "memory_breakdown_gib": [{k: v / GIB for k, v in m.as_dict().items()} for m in est.memory],
        "breakdown": dict(est.breakdown),
    }


def summary(problem: Problem, est: Estimate) -> dict:
    """One line of a table of candidates: the configuration and its predicted numbers, with all it takes to
    rebuild it (its plan.* keys) and to launch it (its Megatron arguments)."""
    c = est.config
    return {
        "tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": c.ep, "vpp": c.vpp, "mbs": c.mbs,
        "zero": c.zero, "recompute": c.recompute, "order": c.order,
        "step_time_s": est.step_time, "peak_memory_gib": est.peak_memory / GIB, "fits": est.fits,
        "shortfall": est.shortfall,
        "plan": choice_keys(est, num_layers=problem.model.cfg.num_layers,
                            mtp_num_layers=problem.model.cfg.mtp_num_layers or 0),
        "layers_per_stage": list(est.layers_per_stage),
        "megatron_args": megatron_args(problem, est),
    }


CONFIG_KEYS = tuple(f.name for f in fields(ParallelConfig))  # each is also a plan.* key (config/schema.py PlanChoice)


def choice_keys(est: Estimate, *, num_layers: int, mtp_num_layers: int = 0) -> dict:
    """Every plan.* key of `est`'s configuration and layer split (None: not given), so that `evaluate` with them
    builds the same configuration and split: the split in the form its Megatron flags take (emit/megatron.py
    split_args), an unset account flag None as PlanChoice has it."""
    c = est.config
    keys = {name: getattr(c, name) for name in CONFIG_KEYS}
    form = (simplest_form(chunk_split(c, est.layers_per_stage), num_layers=num_layers, pp=c.pp,
                          mtp_num_layers=mtp_num_layers) if c.pp > 1 else EVEN)
    keys.update({name: (getattr(form, name) or None) if name in ACCOUNT_FIELDS else getattr(form, name)
                 for name in FORM_FIELDS})
    keys["layers_per_stage"] = None  # the form says it (at most one way is given)
    keys["recompute_modules"] = list(c.selective_modules) or None  # only selective recompute takes modules
    return keys


def key_overrides(keys: dict) -> list[str]:
    """plan.* keys as Hydra overrides (the None ones left out); a string Hydra's grammar would parse is quoted
    (a layout: 'Et|(t*2|)*62,tL')."""
    out = []
    for name, value in keys.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, (list, tuple)):  # layers_per_stage, recompute_modules: Hydra's list syntax
            text = "[" + ",".join(map(str, value)) + "]"
        elif isinstance(value, str) and not re.fullmatch(r"[A-Za-z0-9_-]+", value):
            text = f"'{value}'"
        else:
            text = str(value)
        out.append(f"plan.{name}={text}")
    return out


def megatron_args(problem: Problem, est: Estimate) -> list[str]:
    """The model and the planner's flags of `est`, as the plan emits them."""
    return model_args(problem.model, tp=est.config.tp) + parallel_args(
        est.config,
        model=problem.model,
        global_batch_size=problem.global_batch_size,
        overlap_grad_reduce=problem.overlap_grad_reduce,
        overlap_param_gather=problem.overlap_param_gather,
        layers_per_stage=est.layers_per_stage,
        tp_comm_overlap=problem.tp_comm_overlap,
        moe_dispatcher=problem.moe_dispatcher,
        delay_wgrad_compute=problem.delay_wgrad_compute,
        defer_embedding_wgrad=problem.defer_embedding_wgrad,
    )


def build_plan(problem: Problem, est: Estimate, *, model_name: str, cluster_name: str, overrides: list[str] = (),
               search: dict | None = None, runners_up: list[Estimate] = (), calibration: dict | None = None) -> Plan:
    c, model = est.config, problem.model
    level_names = [lv.name for lv in problem.topology.levels]
    mapping = est.rank_to_device if est.rank_to_device is not None else np.arange(c.world)
    plan = Plan(
        model=model_name,
        cluster=cluster_name,
        accelerator=problem.accelerator.name,
        num_devices=problem.num_devices,
        idle_devices=est.idle_devices,
        parallel={"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": c.ep, "etp": c.etp, "vpp": c.vpp, "sp": c.sp,
                  "cp_comm_type": c.cp_comm_type, "moe_a2a_overlap": c.moe_a2a_overlap,
                  "distributed_optimizer_instances": c.distributed_optimizer_instances,
                  "cpu_offloading_num_layers": c.cpu_offloading_num_layers,
                  "microbatch_group_size_per_vp_stage": c.microbatch_group_size_per_vp_stage},
        micro_batch_size=c.mbs,
        global_batch_size=problem.global_batch_size,
        num_microbatches=est.num_microbatches,
        zero_stage=c.zero,
        zero_flags=list(ZERO_FLAGS[c.zero]),
        recompute=recompute_settings(c, model.cfg.num_layers // (c.pp * c.vpp)),
        layers_per_stage=list(est.layers_per_stage),
        rank_order=c.order,
        rank_to_device=[int(d) for d in mapping],
        group_levels={k: (level_names[v] if v >= 0 else None) for k, v in est.levels.items()},
        predicted=predicted(est),
        megatron_args=megatron_args(problem, est),
        overrides=list(overrides),
        search=search or {"solver": "evaluate", "time_s": 0.0, "configs_evaluated": 1},
        runners_up=[summary(problem, e) for e in runners_up],
        choice=choice_keys(est, num_layers=model.cfg.num_layers, mtp_num_layers=model.cfg.mtp_num_layers or 0),
        hosts=hosts_by_node_rank(problem.topology, mapping),
        failed_hosts=list(problem.topology.failed_hosts),
        calibration=dict(calibration or {}),
        vocabulary=vocabulary(model, c.tp),
    )
    if calibration:
        for row in plan.runners_up:
            row["tied_within_error"] = bool(row["fits"]) and overlaps(row["step_time_s"], est.step_time,
                                                                      calibration.get("errors") or ())
    return plan


def vocabulary(model: ModelSpec, tp: int) -> dict:
    """The vocabulary a plan assumes: the tokenizer's entries (model.vocab_size, which no flag of every tokenizer
    sets), the padding multiple, and the embedding's rows at `tp` (the argv's --padded-vocab-size)."""
    return {"entries": model.cfg.vocab_size, "make_vocab_size_divisible_by": model.cfg.make_vocab_size_divisible_by,
            "padded_rows": model.padded_vocab(tp)}


def hosts_by_node_rank(topology, rank_to_device) -> list[str]:
    """The topology's named hosts in torchrun node-rank order: node rank k runs ranks k*n .. k*n + n - 1, on
    the host of the device rank k*n is placed on; the hosts that run nothing follow in device order."""
    if not topology.hosts:
        return []
    per = topology.devices_per_node
    running = [topology.hosts[int(rank_to_device[r]) // per] for r in range(0, len(rank_to_device), per)]
    busy = set(running)
    return running + [h for h in topology.hosts if h not in busy]
