"""Megatron-FSDP's device mesh, built by megatron-core's own code for the plans the planner emits.

Megatron-LM's get_model (training.py) wraps the model in FullyShardedDataParallel with the process groups of
initialize_model_parallel; its `_init_dist_index` builds the dp_cp x tp mesh (`_get_dp_tp_mesh`, and the expert
mesh of a MoE) of which every rank must be part. With pipeline stages the world holds pp of them and the
mesh's einops refuses (Megatron-LM issue #1455). Here that very method runs, this process posing as a rank
on torch's fake process-group backend, for the chosen plan and runners-up of shipped models on small
clusters, and for every small configuration against parallel.rules (rule `fsdp-pp`).
"""

from __future__ import annotations

import itertools
import types
import warnings
from dataclasses import replace

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("einops")  # Megatron-FSDP's mesh needs it

from megatron_helpers import load_model_config  # noqa: E402

from nest_megatron.config.load import load  # noqa: E402
from nest_megatron.model.spec import ModelSpec  # noqa: E402
from nest_megatron.parallel.config import ParallelConfig  # noqa: E402
from nest_megatron.parallel.rules import violation  # noqa: E402
from nest_megatron.profile.for_plan import profiled_problem  # noqa: E402
from nest_megatron.solver.registry import SOLVERS  # noqa: E402
from nest_megatron.trace.meta import teardown_distributed  # noqa: E402


def fsdp_mesh_error(cfg: ParallelConfig, rank: int, *, moe: bool) -> str | None:
    """What megatron-core's FullyShardedDataParallel._init_dist_index raises as rank `rank` of the plan, or None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron

    prepare_cpu_megatron()
    teardown_distributed()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cfg.world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp, context_parallel_size=cfg.cp,
            expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=cfg.etp if moe else cfg.tp,
            order=cfg.order, create_gloo_process_groups=False)
        strategy = {2: "optim_grads", 3: "optim_grads_params"}[cfg.zero]
        # get_model passes the mpu's groups (pg_collection) to Megatron-FSDP; the method reads only ddp_config.
        wrapper = types.SimpleNamespace(ddp_config=DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            FullyShardedDataParallel._init_dist_index(wrapper, ProcessGroupCollection.use_mpu_process_groups())
        return None
    except Exception as e:  # einops' shape error, or the adapter's rank-consistency assertions
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    finally:
        teardown_distributed()


def planned_configs(overrides: list[str]) -> list[ParallelConfig]:
    """The configurations of the chosen plan and its runners-up, as api.plan finds them."""
    loaded = load(overrides)
    cfg = loaded.config
    problem, _ = profiled_problem(loaded.problem, cfg)
    result = SOLVERS[cfg.solver.name](problem, cfg.solver, cfg.plan, micro_batch_size=cfg.train.micro_batch_size)
    return [e.config for e in (result.best, *result.runners_up)]


# Shipped models on small H100 clusters with a Megatron-FSDP stage pinned, so that every plan is one:
# llama3_8b on 16 devices (without rule fsdp-pp its runners-up include pp 2), llama3_70b on 16 (tp > 1),
# mixtral on 32 with tp 2 (expert meshes for ep 1..8, etp 1 and 2).
CLUSTERS = [
    ["model=llama3_8b", "cluster.num_devices=16", "train.global_batch_size=256", "plan.zero=3"],
    ["model=llama3_70b", "cluster.num_devices=16", "train.global_batch_size=256", "plan.zero=3"],
    ["model=mixtral_8x7b", "cluster.num_devices=32", "train.global_batch_size=256", "plan.zero=2", "plan.tp=2"],
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", CLUSTERS, ids=[c[0] for c in CLUSTERS])
def test_megatron_fsdp_builds_the_mesh_of_every_planned_configuration(overrides):
    configs = planned_configs(["cluster=dgx_h100_superpod", *overrides])
    assert len(configs) >= 5 and all(c.zero >= 2 for c in configs)
    moe = overrides[0] == "model=mixtral_8x7b"
    # the first and the last rank: with pipeline stages they sit on different stages
    failed = {f"tp{c.tp} pp{c.pp} cp{c.cp} dp{c.dp} ep{c.ep} etp{c.etp} rank {rank}": error
              for c in configs for rank in (0, c.world - 1)
              if (error := fsdp_mesh_error(c, rank, moe=moe)) is not None}
    assert failed == {}


def small_configs(model: ModelSpec):
    """Every configuration of 4 or 8 ranks that Megatron launches with the distributed optimizer (ZeRO-1)."""
    moe = model.is_moe
    for world, tp, pp, cp, ep in itertools.product((4, 8), (1, 2, 4), (1, 2, 4), (1, 2), (1, 2, 4) if moe else (1,)):
        if world % (tp * pp * cp):
            continue
        for etp in sorted({1, tp}) if moe else (1,):
            cfg = ParallelConfig(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp), ep=ep, etp=etp, sp=tp > 1, zero=1)
            if violation(cfg, model=model, num_devices=world, global_batch_size=64) is None:
                yield cfg


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_moe"])
def test_rule_fsdp_pp_agrees_with_megatron_fsdp(name):
    """Where the distributed optimizer launches, Megatron-FSDP (ZeRO-3) builds its mesh exactly when our rules
    accept it: on rank 0 and on the last rank, which with pipeline stages is on the last stage."""
    model = ModelSpec(load_model_config(name))
    verdicts = {}
    for cfg in small_configs(model):
        fsdp = replace(cfg, zero=3)
        ours = violation(fsdp, model=model, num_devices=fsdp.world, global_batch_size=64) is None
        builds = all(fsdp_mesh_error(fsdp, rank, moe=model.is_moe) is None for rank in (0, fsdp.world - 1))
        verdicts[fsdp] = (ours, builds)
    # both kinds are there: single-stage configurations build, pipelined ones do not
    assert {builds for _, builds in verdicts.values()} == {True, False}
    assert {f"{c.tp}/{c.pp}/{c.cp}/{c.dp}/{c.ep}/{c.etp}": v for c, v in verdicts.items() if v[0] != v[1]} == {}


def model_parallel_error(cfg: ParallelConfig, *, moe: bool) -> str | None:
    """What megatron-core's initialize_model_parallel raises for `cfg` with its distributed-optimizer instances, this
    process posing as rank 0 on the fake backend, or None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron

    prepare_cpu_megatron()
    teardown_distributed()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp, context_parallel_size=cfg.cp,
            expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=cfg.etp if moe else cfg.tp,
            order=cfg.order, create_gloo_process_groups=False,
            num_distributed_optimizer_instances=cfg.distributed_optimizer_instances)
        return None
    except AssertionError as e:
        return str(e)
    finally:
        teardown_distributed()


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_moe"])
def test_rule_optimizer_instances_agrees_with_megatron_core(name):
    """megatron-core builds the partial data-parallel groups of 2 or 4 distributed-optimizer instances exactly where
    rule optimizer-instances accepts them (dp x cp, and the expert data-parallel size, divisible by them)."""
    model = ModelSpec(load_model_config(name))
    verdicts = {}
    for cfg in small_configs(model):
        for n in (2, 4):
            cfg_n = replace(cfg, distributed_optimizer_instances=n)
            line = violation(cfg_n, model=model, num_devices=cfg_n.world, global_batch_size=64)
            ours = line is None or not line.startswith("plan.distributed_optimizer_instances")
            verdicts[cfg_n] = (ours, model_parallel_error(cfg_n, moe=model.is_moe) is None)
    assert {builds for _, builds in verdicts.values()} == {True, False}
    assert {f"{c.tp}/{c.pp}/{c.cp}/{c.dp}/{c.ep}/{c.etp} x{c.distributed_optimizer_instances}": v
            for c, v in verdicts.items() if v[0] != v[1]} == {}


def test_megatron_core_splits_the_data_parallel_group_into_contiguous_instances():
    """The layout cost/placement.py Spans._partial assumes: with tp 1, dp 16 and 2 instances, rank 0's instance is
    ranks 0-7 (one DGX node) and its shard's replica is rank 8 (the next node), as megatron-core groups them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron

    prepare_cpu_megatron()
    teardown_distributed()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        ps.initialize_model_parallel(create_gloo_process_groups=False, num_distributed_optimizer_instances=2)
        within = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        assert dist.get_process_group_ranks(within) == list(range(8))
        assert dist.get_process_group_ranks(ps.get_inter_distributed_optimizer_instance_group()) == [0, 8]
    finally:
        teardown_distributed()
