"""The configurations a planner searches: every Megatron-launchable one, within the user's pins."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.cost.offload import why_not_offloaded
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.recompute import ordered, searched_sets
from nest_megatron.errors import NestError
from nest_megatron.parallel.config import CP_COMM_TYPES, DEFAULT_RECOMPUTE_MODULES, ParallelConfig
from nest_megatron.parallel.layout import EVEN, MIN_STAGE_LAYERS, SplitForm, chunk_layers, form_vpp
from nest_megatron.parallel.rules import (
    Broken,
    broken_apart,
    first_of,
    microbatch_group_problem,
    refused_by_pipeline,
    refused_by_sizes,
    refused_overlap,
    violation,
)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, from its prime factorisation (trial division up to sqrt(n): a
    device count of 10^12 takes 10^6 steps at worst, not 10^12)."""
    found = [1]
    p = 2
    while p * p <= n:
        power = 0
        while n % p == 0:
            n //= p
            power += 1
        found += [d * p**k for d in found for k in range(1, power + 1)]
        p += 1 if p == 2 else 2
    if n > 1:
        found += [d * n for d in found]
    return sorted(found)


def choice_config(problem: Problem, choice: PlanChoice, *, default_mbs: int | None) -> ParallelConfig:
    """The user's choice, Megatron's defaults elsewhere (not checked against Megatron's rules)."""
    tp, pp, cp = choice.tp or 1, choice.pp or 1, choice.cp or 1
    dp = choice.dp or problem.num_devices // (tp * cp * pp)
    return ParallelConfig(
        tp=tp, pp=pp, cp=cp, dp=max(dp, 1),
        ep=choice.ep or 1,
        etp=choice.etp or (tp if problem.model.is_moe else 1),
        vpp=choice.vpp or split_vpp(choice),
        sp=choice.sp if choice.sp is not None else tp > 1,
        mbs=choice.mbs or default_mbs or 1,
        zero=choice.zero if choice.zero is not None else 1,
        recompute=choice.recompute or ("selective" if choice.recompute_modules is not None else "none"),
        recompute_num_layers=choice.recompute_num_layers,
        recompute_modules=(ordered(choice.recompute_modules) if choice.recompute_modules is not None
                           else DEFAULT_RECOMPUTE_MODULES),
        order=choice.order or "tp-cp-ep-dp-pp",
        cp_comm_type=choice.cp_comm_type or "p2p",
        # --delay-wgrad-compute runs only with the overlap (config/load.py)
        moe_a2a_overlap=problem.delay_wgrad_compute if choice.moe_a2a_overlap is None else choice.moe_a2a_overlap,
        distributed_optimizer_instances=choice.distributed_optimizer_instances or 1,
        cpu_offloading_num_layers=choice.cpu_offloading_num_layers or 0,
        microbatch_group_size_per_vp_stage=choice.microbatch_group_size_per_vp_stage,
    )


def split_vpp(choice: PlanChoice) -> int:
    """The virtual stages a pinned split of pp*vpp entries or a layout implies (Megatron's layout sets vpp so); 1
    otherwise."""
    split, pp = choice.layers_per_stage, choice.pp
    if choice.pipeline_model_parallel_layout is not None and pp:
        return form_vpp(SplitForm.from_fields(choice), pp=pp) or 1
    return len(split) // pp if split and pp and len(split) % pp == 0 else 1


def pinned_split(choice: PlanChoice) -> tuple[int, ...] | None:
    """plan.layers_per_stage as given (pp or pp*vpp entries), None when not given."""
    return tuple(choice.layers_per_stage) if choice.layers_per_stage is not None else None


def pinned_chunks(choice: PlanChoice, cfg: ParallelConfig, *, num_layers: int) -> tuple[int, ...] | None:
    """The split the plan.* keys fix for `cfg` (which satisfies parallel.rules with them): plan.layers_per_stage,
    or the model chunks Megatron builds for the form the keys give at cfg's pp x vpp; None when the split is free
    (`plan`) or Megatron's even one (`evaluate`)."""
    form = SplitForm.from_fields(choice)
    if choice.layers_per_stage is not None or form == EVEN:
        return pinned_split(choice)
    return chunk_layers(form, num_layers=num_layers, pp=cfg.pp, vpp=cfg.vpp)


def evaluate_config(problem: Problem, choice: PlanChoice, *, default_mbs: int | None) -> ParallelConfig:
    """The one configuration `evaluate` scores: the user's choice, Megatron's defaults elsewhere."""
    cfg = choice_config(problem, choice, default_mbs=default_mbs)
    problem_line = violation(cfg, model=problem.model, num_devices=problem.num_devices, global_batch_size=problem.global_batch_size,
                             layers_per_stage=pinned_split(choice), tp_comm_overlap=problem.tp_comm_overlap,
                             form=SplitForm.from_fields(choice))
    if problem_line:
        raise NestError(f"invalid configuration: {problem_line}")
    line = train_rule_line(problem, cfg)
    if line is not None:
        raise NestError(f"invalid configuration: {line}")
    return cfg


# --tp-comm-overlap needs sequence parallel (Megatron-LM arguments.py:1441-1442), which only TP > 1 has
TP_COMM_OVERLAP_LINE = ("plan.sp=false with plan.tp={tp} and train.tp_comm_overlap=true: TP communication overlaps "
                        "only the sequence-parallel all-gather / reduce-scatter (Megatron asserts it); set plan.sp=true "
                        "or train.tp_comm_overlap=false")
# --use-precision-aware-optimizer needs the distributed optimizer (megatron/core/optimizer/__init__.py:1057); under
# Megatron-FSDP its main weights are FSDP's own buffer (--megatron-fsdp-main-params-dtype), which the cost model
# does not price: the distributed optimizer only.
PRECISION_AWARE_LINE = ("plan.zero={zero} and train.precision_aware_optimizer=true: the precision-aware optimizer runs "
                        "with the distributed optimizer (plan.zero=1; Megatron refuses it without one, and Megatron-FSDP "
                        "keeps its own main weights); set plan.zero=1 or train.precision_aware_optimizer=false")


# Megatron's flex dispatcher with DeepEP asserts expert TP x EP > 1 (megatron/core/transformer/moe/
# token_dispatcher.py:1836, MoEFlexTokenDispatcher.__init__, at run time; its tp_size is the expert TP group's, :89).
DEEPEP_LINE = ("plan.etp=1 and plan.ep=1 with train.moe_dispatcher=deepep: Megatron's DeepEP dispatcher needs expert "
               "TP x EP > 1; give plan.ep > 1, or another dispatcher")
# megatron/core/model_parallel_config.py:545-548 at d98e8a6 (ValueError in __post_init__)
DEFER_EMBEDDING_WGRAD_LINE = ("plan.pp=1 with train.defer_embedding_wgrad_compute=true: megatron-core defers the output "
                              "layer's weight gradient only with pipeline parallelism; give plan.pp > 1 or drop "
                              "--defer-embedding-wgrad-compute")


def train_rule_line(problem: Problem, cfg: ParallelConfig) -> str | None:
    """The train.* choice the configuration does not launch with, as one line; None when it launches."""
    if problem.tp_comm_overlap and cfg.tp > 1 and not cfg.sp:
        return TP_COMM_OVERLAP_LINE.format(tp=cfg.tp)
    dtypes = problem.model.numerics.optimizer_dtypes
    if dtypes is not None and dtypes.megatron and cfg.zero != 1:
        return PRECISION_AWARE_LINE.format(zero=cfg.zero)
    if problem.moe_dispatcher == "deepep" and problem.model.is_moe and cfg.etp * cfg.ep == 1:
        return DEEPEP_LINE
    if problem.defer_embedding_wgrad and cfg.pp == 1:
        return DEFER_EMBEDDING_WGRAD_LINE
    return None


def candidates(
    problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None, any_split: bool = False,
    world: int | None = None,
) -> Iterator[ParallelConfig]:
    """Every configuration that uses all devices (or `world` of them, the rest idle), satisfies Megatron's
    rules and the pins; with `any_split`, also those whose layers only split unevenly over the stages."""
    for cfg, broken in _configurations(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=any_split,
                                       world=world, launchable_only=True):
        if broken is None:
            yield cfg


def launchable_world(problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None,
                     any_split: bool = False) -> int | None:
    """The most devices some configuration of the space runs on: all of them when Megatron can, else the
    fewest left idle, in whole hosts (torchrun starts the same number of ranks on every node). 37 nodes
    whose 296 GPUs no batch-dividing data-parallel size fills fall back to 36 nodes, 35, ... None when
    even one host (or one device) runs nothing."""
    devices, host = problem.num_devices, problem.topology.devices_per_node
    step = host if devices > host else 1
    for world in dict.fromkeys([devices, *range(devices // step * step, 0, -step)]):
        if next(candidates(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=any_split,
                           world=world), None) is not None:
            return world
    return None


def searched_worlds(problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None,
                    any_split: bool = False) -> list[int]:
    """The device counts the search runs configurations on: `launchable_world`, and, when its host count is
    awkward, the largest host counts below it of the form 2^k x m for each m of ODD_PARTS. Batches and TP are
    powers of two, so the odd part of a world is the pipeline's: 15 nodes fill only with 15 stages (2 layers
    each for a 32-layer model, much of the step lost to the bubble and transfers), where 8 (no pipeline), 12
    (PP 3), 10 (PP 5) or 14 nodes (PP 7) can be faster; the cost model picks. A host count whose odd part is
    in ODD_PARTS (the usual cluster: a power of two) searches one world. With solver.allow_idle false, only
    every device."""
    if not solver.allow_idle:
        every = next(candidates(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=any_split), None)
        return [problem.num_devices] if every is not None else []
    first = launchable_world(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=any_split)
    if first is None:
        return []
    host = problem.topology.devices_per_node
    hosts = first // host
    if first <= host or _odd_part(hosts) in ODD_PARTS:
        return [first]
    worlds = [first]
    for odd in (m for m in ODD_PARTS if m <= hosts):
        world = host * odd * 2 ** ((hosts // odd).bit_length() - 1)  # the most hosts of the form 2^k x odd
        if next(candidates(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=any_split,
                           world=world), None) is not None:
            worlds.append(world)
    return worlds


# The odd factors of a host count worth searching below an awkward one: pipelines of 1, 3, 5 or 7 x 2^k stages.
ODD_PARTS = (1, 3, 5, 7)


def _odd_part(n: int) -> int:
    return n // (n & -n)


def empty_space_reason(
    problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None, any_split: bool = False
) -> str:
    """Why `candidates` yields nothing, as one line: the Megatron rule the pinned values break (Megatron's
    defaults elsewhere), else the rule most configurations of the search space break."""
    pinned = {name: value for name, value in vars(pins).items() if value is not None}
    if pinned:
        cfg = choice_config(problem, pins, default_mbs=micro_batch_size)
        # the search tries every CP exchange where Transformer Engine refuses the default one (`_configurations`)
        comm_types = [cfg.cp_comm_type] if pins.cp_comm_type or cfg.cp == 1 else list(CP_COMM_TYPES)
        lines = [violation(replace(cfg, cp_comm_type=t), model=problem.model, num_devices=problem.num_devices,
                           global_batch_size=problem.global_batch_size, any_split=any_split,
                           layers_per_stage=pinned_split(pins), tp_comm_overlap=problem.tp_comm_overlap,
                           form=SplitForm.from_fields(pins))
                 for t in comm_types]
        line = None if None in lines else lines[0]
        if line is None:
            line = train_rule_line(problem, cfg)
        if line is None and problem.num_devices % (cfg.tp * cfg.cp * cfg.pp):
            line = _unused_devices(cfg.tp, cfg.cp, cfg.pp, problem.num_devices)
        if line is not None:
            return f"{line} ({', '.join(f'plan.{name}={value}' for name, value in pinned.items())} pinned)"
    space = list(_configurations(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=any_split))
    # Sizes whose product leaves devices over are no configuration; they speak only when nothing else does.
    broken = [line for cfg, line in space if cfg is not None] or [line for _, line in space]
    if not broken:
        return "the search space is empty (a solver.* list holds nothing to try)"
    # Lines name their value before the first colon; the values of the other sizes vary after it.
    per_rule = Counter(line.partition(":")[0] for line in broken)
    rule, count = per_rule.most_common(1)[0]
    line = next(line for line in broken if line.partition(":")[0] == rule)
    if count == len(broken):
        return f"{line} (this rules out all {count} configurations in the search space)"
    return f"{line} (this rules out {count} of the {len(broken)} configurations in the search space, other rules the rest)"


def _unused_devices(tp: int, cp: int, pp: int, devices: int) -> str:
    return (f"cluster.num_devices={devices}: must be a multiple of tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp} "
            "(the planner uses every device)")


def tensor_parallel_sizes(problem: Problem) -> list[int]:
    """The TP sizes searched: those that divide the heads and the query groups and keep every TP group inside one
    NVLink domain (Topology.domain_devices: a host's devices, or a GB200 NVL72 rack's 72 across its 18 trays). No
    Megatron rule bounds TP by the node (megatron/training/arguments.py:432 asks only that tp*pp*cp divide the
    world; parallel_state.py builds groups of any ranks; Transformer Engine's userbuffers for --tp-comm-overlap take
    a TP group larger than a node's local ranks, pytorch/module/base.py:386 at v2.11); a TP group's collectives sit
    on every layer's critical path, and off NVLink they would run at the NIC's bandwidth, so the search keeps them
    on it."""
    model = problem.model
    return [t for t in divisors(problem.topology.domain_devices)
            if model.heads % t == 0 and model.query_groups % t == 0]


def searched_a2a_overlaps(problem: Problem, solver: SolverConfig) -> list[bool]:
    """The EP all-to-all overlaps searched (--overlap-moe-expert-parallel-comm): solver.moe_a2a_overlap, without true
    where the run as a whole has none: a model without experts, not a GPT model (only GPTModel builds the combined
    schedule's plan, models/gpt/gpt_model.py:843 at d98e8a6: a hybrid Mamba stack or BERT has none), the allgather
    dispatcher, more than one multi-token-prediction layer, the shared expert overlapped with the dispatch
    (transformer_config.py:3002-3046), or CUDA graphs (Transformer Engine's graphs of the MoE or MLP scope refuse
    it, :3062-3071, and the argv's scope is the user's). A pinned plan.moe_a2a_overlap is the user's (config/load.py
    refuses it where Megatron does)."""
    model = problem.model
    possible = (model.is_moe and model.is_gpt_model and problem.moe_dispatcher != "allgather"
                and (model.cfg.mtp_num_layers or 0) <= 1 and not model.cfg.moe_shared_expert_overlap
                and not problem.cuda_graphs)
    return [value for value in solver.moe_a2a_overlap if possible or not value]


def searched_offloads(problem: Problem, solver: SolverConfig) -> list[int]:
    """The activation offloads searched (--cpu-offloading-num-layers): solver.cpu_offloading of the model's layers,
    at most all but the last, where the run can offload at all (cost/offload.py why_not_offloaded). 0: none."""
    layers = problem.model.cfg.num_layers
    if why_not_offloaded(problem.accelerator, cuda_graphs=problem.cuda_graphs) or layers < 2:
        return [0]
    return sorted({min(layers - 1, round(share * layers)) for share in solver.cpu_offloading})


def microbatch_group(pinned: int | None, *, pp: int, vpp: int, microbatches: int) -> int | None:
    """The micro-batches a model chunk runs at a time (--microbatch-group-size-per-virtual-pipeline-stage): the
    pinned group; else Megatron's default, pp (None), where pp divides the micro-batches or nothing is interleaved;
    else the smallest group that lets the interleaved schedule run them (each group but the last full, the last none
    or at least pp: parallel/rules.py microbatch_group_problem), the fewest micro-batches in flight in its warm-up.
    None where none does (fewer micro-batches than pp): the rule then says so."""
    if pinned is not None or vpp == 1 or microbatches % pp == 0:
        return pinned
    return next((g for g in range(pp + 1, microbatches + 1) if microbatch_group_problem(microbatches, g, pp) is None),
                None)


def stage_counts(num_layers: int, devices: int, *, any_split: bool) -> list[int]:
    """The pipeline sizes searched: those that leave each stage at least MIN_STAGE_LAYERS layers (PP 37 on
    80 layers: 2 or 3 a stage, never 1), among the divisors of the devices with `any_split`, else among
    those of the layers (even splits)."""
    sizes = divisors(devices) if any_split else divisors(num_layers)
    return [p for p in sizes if p == 1 or p * MIN_STAGE_LAYERS <= num_layers]


def _configurations(
    problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None, any_split: bool,
    world: int | None = None, launchable_only: bool = False,
) -> Iterator[tuple[ParallelConfig | None, str | None]]:
    """The search space within the pins on `world` devices (None: all): (cfg, None) for each configuration
    Megatron launches, (cfg or None, the rule's line) for each it does not. With `launchable_only`, the
    configurations parallel/rules.py SIZE_RULES refuse by their sizes alone are left out unjudged: four fifths of a
    MoE model's space (712,640 of 900,644 for DeepSeek-V3 on 256 GPUs), none of which `candidates` would yield; so are
    the virtual stages and micro-batch sizes PIPELINE_RULES refuse at a PP and DP (DeepSeek-V3 on 1,152 GB200: 1,178,041
    configurations judged for 241,060 launchable before, 241,101 after; 8.8 -> 2.3 s), and the EP all-to-all overlaps
    OVERLAP_RULES refuse at a PP, VPP, EP and recompute kind (tests/test_search_space.py holds it to the rules)."""
    model, devices = problem.model, world or problem.num_devices
    form = SplitForm.from_fields(pins)  # once: every configuration is judged with it

    def axis(pinned, values):
        return [pinned] if pinned is not None else values

    tps = axis(pins.tp, tensor_parallel_sizes(problem))
    cps = axis(pins.cp, [c for c in (1, 2, 4, 8, 16, 32) if c <= solver.max_context_parallel])
    pps = axis(pins.pp, stage_counts(model.cfg.num_layers, devices, any_split=any_split))
    mbss = axis(pins.mbs, [micro_batch_size] if micro_batch_size else list(solver.micro_batch_sizes))
    zeros = axis(pins.zero, list(solver.zero_stages))
    instances = pins.distributed_optimizer_instances or 1  # not searched
    offloads = axis(pins.cpu_offloading_num_layers, searched_offloads(problem, solver))
    overlaps = axis(pins.moe_a2a_overlap, [True] if problem.delay_wgrad_compute else searched_a2a_overlaps(problem, solver))
    recomputes = axis(pins.recompute, ["selective"] if pins.recompute_modules is not None else list(solver.recompute))
    recomputed_counts = axis(pins.recompute_num_layers, list(solver.recompute_num_layers))
    # What each recompute kind is searched with: full, the recomputed layer counts; selective, its module sets.
    variants = {"none": [(None, DEFAULT_RECOMPUTE_MODULES)],
                "full": [(n, DEFAULT_RECOMPUTE_MODULES) for n in recomputed_counts],
                "selective": [(None, m) for m in ([ordered(pins.recompute_modules)] if pins.recompute_modules
                                                  is not None else searched_sets(model))]}
    judge = _Judge(problem, pins, any_split, form)
    pipeline_context = dict(model=model, global_batch_size=problem.global_batch_size, layers_per_stage=pinned_split(pins),
                            any_split=any_split, form=form)
    for tp, cp, pp in itertools.product(tps, cps, pps):
        if devices % (tp * cp * pp):
            yield None, _unused_devices(tp, cp, pp, devices)
            continue
        dp = pins.dp or devices // (tp * cp * pp)
        experts = model.cfg.num_experts or 1
        eps = axis(pins.ep, [e for e in divisors(experts) if (tp * cp * dp) % e == 0])
        etps = axis(pins.etp, sorted({1, tp}) if model.is_moe else [1])
        sps = axis(pins.sp, [tp > 1])
        vpps = axis(pins.vpp, [v for v in range(1, solver.max_virtual_stages + 1) if v == 1 or pp > 1])
        if pins.vpp is None and split_vpp(pins) > 1:
            vpps = [split_vpp(pins)]  # a split of pp*vpp entries or a layout fixes vpp
        # With one pipeline stage or one replica both Megatron orders build the same groups.
        orders = axis(pins.order, list(solver.rank_orders) if pp > 1 and dp > 1 else solver.rank_orders[:1])
        # Transformer Engine's CP exchange: without CP there is none to choose (Megatron's default stands); with CP,
        # solver.cp_comm_types, and where TE runs none of those for a configuration (sliding-window attention
        # refuses p2p), the other exchanges it runs. A pinned one is the user's: no other.
        comm_types = axis(pins.cp_comm_type, list(solver.cp_comm_types) if cp > 1 else ["p2p"])
        fallback = [t for t in CP_COMM_TYPES if t not in comm_types] if cp > 1 and pins.cp_comm_type is None else []
        refused: dict[tuple, bool] = {}  # (ep, etp, zero, order) -> whether SIZE_RULES refuse it
        refused_overlaps: dict[tuple, bool] = {}  # (vpp, ep, recompute) -> whether OVERLAP_RULES refuse the overlap
        pipelines = [(vpp, mbs, group) for vpp, mbs in itertools.product(vpps, mbss)
                     for group in [microbatch_group(pins.microbatch_group_size_per_vp_stage, pp=pp, vpp=vpp,
                                                    microbatches=problem.global_batch_size // (dp * mbs))]
                     if not (launchable_only and refused_by_pipeline(pp, vpp, mbs, dp, **pipeline_context,
                                                                     microbatch_group_size_per_vp_stage=group))]
        for ep, etp, sp, (vpp, mbs, group), zero, recompute, order, overlap in itertools.product(
                eps, etps, sps, pipelines, zeros, recomputes, orders, overlaps):
            if overlap and ep == 1 and pins.moe_a2a_overlap is None:
                continue  # no all-to-all to overlap (a pinned overlap hears the rule's line)
            if overlap and launchable_only:
                by_overlap = (vpp, ep, recompute)
                if by_overlap not in refused_overlaps:
                    refused_overlaps[by_overlap] = refused_overlap(pp, vpp, ep, recompute)
                if refused_overlaps[by_overlap]:
                    continue
            if launchable_only:
                by_sizes = (ep, etp, zero, order)
                if by_sizes not in refused:
                    refused[by_sizes] = refused_by_sizes(
                        ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, zero=zero, order=order), model)
                if refused[by_sizes]:
                    continue
            # megatron-core offloads only at pp 1 without recompute (the cpu-offloading rule): a searched offload
            # elsewhere would only be refused; a pinned one hears the rule's line
            pinned_or_possible = pins.cpu_offloading_num_layers is not None or (pp == 1 and recompute == "none")
            others = (tp, cp, pp, dp, ep, etp, sp, vpp, mbs, zero, order, instances, group)  # not the variants' fields
            for offloaded, (recomputed, modules) in itertools.product(
                    offloads if pinned_or_possible else [0],
                    variants.get(recompute, [(None, DEFAULT_RECOMPUTE_MODULES)])):
                sizes = dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=vpp, sp=sp, mbs=mbs, zero=zero,
                             recompute=recompute, recompute_num_layers=recomputed, recompute_modules=modules,
                             order=order, moe_a2a_overlap=overlap, distributed_optimizer_instances=instances,
                             cpu_offloading_num_layers=offloaded, microbatch_group_size_per_vp_stage=group)
                first = ParallelConfig(**sizes, cp_comm_type=comm_types[0])
                train_line = train_rule_line(problem, first)  # whatever the exchange
                if train_line is not None:
                    yield None, train_line
                    continue
                variant = (recompute, recomputed, modules, overlap, offloaded, pp, vpp, ep)
                found = judge(sizes, comm_types, others, variant, first=first)
                if fallback and all(line is not None for _, line in found):
                    found += judge(sizes, fallback, others, variant)
                yield from found


class _Judge:
    """Each configuration with each CP exchange, and the rule it breaks (None: it launches), as rules.violation says,
    judged in two halves that are kept: the rules but VARIANT_RULES answer the same for the configurations that
    differ only in their recompute fields, EP all-to-all overlap and offloaded layers (their variants), VARIANT_RULES
    for those with the same variant fields, pp, vpp and ep."""

    def __init__(self, problem: Problem, pins: PlanChoice, any_split: bool, form: SplitForm):
        self.context = dict(model=problem.model, num_devices=problem.num_devices,
                            global_batch_size=problem.global_batch_size, any_split=any_split,
                            layers_per_stage=pinned_split(pins), tp_comm_overlap=problem.tp_comm_overlap,
                            form=form)
        self.others: dict[tuple, Broken | None] = {}  # (every field but the variants' ones) -> the first rule broken
        self.variants: dict[tuple, Broken | None] = {}  # (the variant fields, pp, vpp, ep) -> the first rule broken

    def __call__(self, sizes: dict, comm_types: list[str], others: tuple, variant: tuple, *,
                 first: ParallelConfig | None = None) -> list[tuple[ParallelConfig, str | None]]:
        """`others` and `variant` are the keys of `sizes`' halves; `first`, when given, the configuration with
        comm_types[0], already built."""
        out = []
        for comm_type in comm_types:
            cfg = first if first is not None and comm_type == first.cp_comm_type else ParallelConfig(**sizes, cp_comm_type=comm_type)
            key = (*others, comm_type)
            if key not in self.others:
                self.others[key] = broken_apart(cfg, variant=False, **self.context)
            if variant not in self.variants:
                self.variants[variant] = broken_apart(cfg, variant=True, **self.context)
            out.append((cfg, first_of(self.others[key], self.variants[variant])))
        return out
