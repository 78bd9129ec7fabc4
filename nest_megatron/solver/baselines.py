"""Baselines under the one cost model: what the planner is compared against.

Every baseline picks configurations its own way and scores them only through
`cost.evaluate.estimate`; none of them prices anything itself.

- `manual`: the habits of Megatron / NeMo recipes (TP = node size for large models, the smallest
  PP that fits, distributed optimizer, selective then full recompute, micro-batch 1).
- `paper`: the NEST paper's Manual / MCMC / Phaze (p, d, t) entries for one cell of its grid.
- `flat_network`: any planner run on a network whose every level is priced like level 0 (Phaze's
  view of the cluster); the configuration it picks is re-scored on the real network.
- `annealing`, `mcmc`: simulated annealing and a Metropolis chain (FlexFlow's search) over the
  planner's own space, with a fixed budget of evaluations, deterministic for a seed.

Every function returns Estimates; the benchmark (scripts/bench_paper_grid.py) turns one into a
Plan with `search={"solver": <baseline name>, ...}` (`search_record`); plan.build_plan lives a
layer above the solvers, so the Plan itself is built there.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.cost.evaluate import Estimate, estimate
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.hardware.topology import Topology
from nest_megatron.parallel.config import RANK_ORDERS, RECOMPUTE_KINDS, ParallelConfig
from nest_megatron.parallel.rules import violation
from nest_megatron.solver.paper_grid import BASELINE_KEYS, load_grid
from nest_megatron.solver.paper_grid import baselines as paper_baselines
from nest_megatron.solver.space import candidates, divisors, evaluate_config

LARGE_MODEL_PARAMS = 20e9  # above this, recipes put TP across the whole node
MANUAL_ORDER = "tp-cp-ep-dp-pp"  # Megatron's default rank order


def search_record(name: str, *, time_s: float = 0.0, configs_evaluated: int = 1, **extra) -> dict:
    """The Plan's `search` field for a configuration a baseline found."""
    return {"solver": name, "time_s": time_s, "configs_evaluated": configs_evaluated, **extra}


# --- manual: Megatron / NeMo recipe habits ---------------------------------------------------------------

def total_params(problem: Problem) -> int:
    """Parameters of the whole model (one copy, no parallelism)."""
    model = problem.model
    layers = sum(sum(model.layer_params(tp=1, ep=1, etp=1, kind=kind)) for kind in model.layer_kinds)
    mtp = model.mtp_physical_depths * sum(sum(model.layer_params(tp=1, kind=kind)) for kind in model.mtp_depth_kinds)
    return layers + mtp + model.embedding_params(1) + model.output_params(tp=1, pp=1)


def _valid(problem: Problem, cfg: ParallelConfig) -> bool:
    return violation(cfg, model=problem.model, num_devices=problem.num_devices,
                     global_batch_size=problem.global_batch_size, tp_comm_overlap=problem.tp_comm_overlap) is None


def manual_candidates(problem: Problem) -> list[ParallelConfig]:
    """The configurations a recipe tries, in the order it tries them (valid ones only)."""
    model, devices = problem.model, problem.num_devices
    node = problem.topology.devices_per_node
    tps = [t for t in divisors(node) if model.heads % t == 0 and model.query_groups % t == 0]
    if total_params(problem) > LARGE_MODEL_PARAMS:
        tps = [max(tps)]  # the node size, or the largest TP within the node the heads allow
    out = []
    for recompute in ("selective", "full"):
        for tp in tps:
            for pp in divisors(model.cfg.num_layers):
                if devices % (tp * pp):
                    continue
                dp = devices // (tp * pp)
                etp = tp if model.is_moe else 1
                ep = 1
                if model.is_moe:
                    ep = max(e for e in divisors(model.cfg.num_experts) if (tp * dp) % (etp * e) == 0)
                cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=1, ep=ep, etp=etp, vpp=1, sp=tp > 1, mbs=1, zero=1,
                                     recompute=recompute, order=MANUAL_ORDER)
                if _valid(problem, cfg):
                    out.append(cfg)
    return out


def manual(problem: Problem) -> Estimate | None:
    """The first recipe configuration that Megatron accepts and that fits: with selective
    recompute, TP = node size for models over 20e9 parameters (else the smallest TP for which some
    PP fits), then the smallest PP; the same with full recompute when nothing fits."""
    for cfg in manual_candidates(problem):
        est = estimate(problem, cfg)
        if est.fits:
            return est
    return None


# --- the paper's baselines ---------------------------------------------------------------------------------

def _grid_cluster(cluster_name: str, micro_batch_size: int, num_devices: int) -> str:
    """The grid's cluster key: the mbs-specific table (tpuv4_fatTree_mbs2, ...) when it has this cell."""
    key = BASELINE_KEYS.get(cluster_name, cluster_name)
    if micro_batch_size > 1 and num_devices in load_grid()["baselines"].get(f"{key}_mbs{micro_batch_size}", {}):
        return f"{key}_mbs{micro_batch_size}"
    return cluster_name


def paper(problem: Problem, *, cluster_name: str, model_name: str, num_devices: int,
          micro_batch_size: int = 1) -> list[tuple[str, Estimate | None, str | None]]:
    """The paper's Manual / MCMC / Phaze entries for this cell, as (name, Estimate or None, why skipped).

    Each (p, d, t) (with the model's expert parallel: paper_grid) is scored with the distributed
    optimizer (zero=1: Megatron-FSDP, ZeRO 2/3, does not run with pp > 1, which all but BERT's p=1
    entries have), the given micro-batch, no recompute, or selective recompute when it does not fit without;
    entries Megatron cannot launch (paper_grid says why) or that do not fit either way are skipped.
    An empty list: the grid has no entry for this cell.
    """
    out = []
    for b in paper_baselines(cluster=_grid_cluster(cluster_name, micro_batch_size, num_devices),
                             num_devices=num_devices, model=model_name, num_layers=problem.model.cfg.num_layers,
                             global_batch_size=problem.global_batch_size, micro_batch_size=micro_batch_size):
        if b.overrides is None:
            out.append((b.name, None, b.skipped))
            continue
        pinned = {k.split(".", 1)[1]: int(v) for k, v in (o.split("=", 1) for o in b.overrides)}
        est, reason = None, None
        for recompute in ("none", "selective"):
            try:
                cfg = evaluate_config(problem, PlanChoice(**pinned, zero=1, recompute=recompute),
                                      default_mbs=micro_batch_size)
            except NestError as err:
                reason = str(err)
                break
            est = estimate(problem, cfg)
            if est.fits:
                break
            reason = f"does not fit: {est.shortfall} even with selective recompute"
            est = None
        out.append((b.name, est, None if est is not None else reason))
    return out


# --- flat network (Phaze) ----------------------------------------------------------------------------------

def flat_topology(topology: Topology) -> Topology:
    """The same fan-outs with every level priced as level 0 (bandwidth, its efficiency, latency, oversubscription)."""
    base = topology.levels[0]
    levels = tuple(replace(lv, bandwidth=base.bandwidth, efficiency=base.efficiency, latency=base.latency,
                           oversubscription=base.oversubscription)
                   for lv in topology.levels)
    return replace(topology, name=f"{topology.name}_flat", levels=levels)


@dataclass
class FlatResult:
    best: Estimate | None  # the flat search's choice, re-scored on the real network
    flat: Estimate | None  # the same choice as the flat search priced it
    search: object  # the solver's SearchResult on the flat problem


def flat_network_search(problem: Problem, solve: Callable, *, solver_cfg: SolverConfig | None = None,
                        pins: PlanChoice | None = None, micro_batch_size: int | None = None) -> FlatResult:
    flat_problem = replace(problem, topology=flat_topology(problem.topology))
    result = solve(flat_problem, solver_cfg or SolverConfig(), pins or PlanChoice(), micro_batch_size=micro_batch_size)
    if result.best is None:
        return FlatResult(None, None, result)
    rank_to_device = getattr(result, "rank_to_device", None)
    real = estimate(problem, result.best.config, layers_per_stage=result.best.layers_per_stage,
                    rank_to_device=rank_to_device)
    return FlatResult(real, result.best, result)


def flat_network(problem: Problem, solve: Callable, *, solver_cfg: SolverConfig | None = None,
                 pins: PlanChoice | None = None, micro_batch_size: int | None = None) -> Estimate | None:
    """Run `solve` (a SOLVERS entry) believing every link is as fast as level 0, as Phaze does;
    return its choice priced on the real network."""
    return flat_network_search(problem, solve, solver_cfg=solver_cfg, pins=pins, micro_batch_size=micro_batch_size).best


# --- local search: simulated annealing and Metropolis MCMC -------------------------------------------------

MOVES = ("tp", "pp", "cp", "mbs", "zero", "recompute", "order", "vpp", "ep", "etp")
RESTART_PROBABILITY = 0.05
MAX_STEPS_PER_EVALUATION = 20  # proposals that revisit cached configurations are free; this bounds them


def _rank(attr: str, value) -> int | float:
    if attr == "recompute":
        return RECOMPUTE_KINDS.index(value)
    if attr == "order":
        return RANK_ORDERS.index(value)
    return value


class Walk(NamedTuple):
    best: Estimate | None
    evaluations: int  # calls to estimate


class _Space:
    """The planner's configurations, materialised once, with the moves between them."""

    def __init__(self, configs: list[ParallelConfig]):
        self.configs = configs
        self.values = {a: sorted({getattr(c, a) for c in configs}, key=lambda v, a=a: _rank(a, v)) for a in MOVES}
        # Configuration i as the positions of its values: moves compare rows of this matrix.
        self.codes = np.array([[self.values[a].index(getattr(c, a)) for a in MOVES] for c in configs], dtype=np.int32)
        self.with_value = {(j, v): np.flatnonzero(self.codes[:, j] == v)
                           for j, a in enumerate(MOVES) for v in range(len(self.values[a]))}

    def neighbour(self, i: int, rng: random.Random) -> int | None:
        """Change one attribute of configuration i to the next value up or down that some valid
        configuration has, keeping as many of the others as possible; None if none can move."""
        attrs = [j for j, a in enumerate(MOVES) if len(self.values[a]) > 1]
        rng.shuffle(attrs)
        for j in attrs:
            here = int(self.codes[i, j])
            steps = [s for s in (-1, 1) if 0 <= here + s < len(self.values[MOVES[j]])]
            rng.shuffle(steps)
            for s in steps:
                pool = self.with_value[(j, here + s)]
                if not len(pool):
                    continue
                other = np.delete(self.codes[pool] != self.codes[i], j, axis=1).sum(axis=1)
                nearest = pool[other == other.min()]
                return int(nearest[rng.randrange(len(nearest))])
        return None


def _space(problem: Problem, solver_cfg: SolverConfig | None, micro_batch_size: int | None) -> _Space:
    return _Space(list(candidates(problem, solver_cfg or SolverConfig(), PlanChoice(), micro_batch_size=micro_batch_size)))


def _local_search(problem: Problem, *, budget: int, seed: int, solver_cfg: SolverConfig | None,
                  micro_batch_size: int | None, temperature: Callable[[int], float]) -> Walk:
    """Metropolis acceptance on the relative change of step time (inf: does not fit), at the
    temperature `temperature(evaluations so far)`; a proposal is a neighbour or a random restart."""
    space = _space(problem, solver_cfg, micro_batch_size)
    if not space.configs or budget <= 0:
        return Walk(None, 0)
    rng = random.Random(seed)
    seen: dict[int, Estimate] = {}

    def score(i: int) -> float:
        if i not in seen:
            seen[i] = estimate(problem, space.configs[i])
        est = seen[i]
        return est.step_time if est.fits else math.inf

    cur = rng.randrange(len(space.configs))
    cur_cost = score(cur)
    best, best_cost = cur, cur_cost
    steps = 0
    while len(seen) < budget and steps < MAX_STEPS_PER_EVALUATION * budget:
        steps += 1
        nxt = None if rng.random() < RESTART_PROBABILITY else space.neighbour(cur, rng)
        if nxt is None:
            nxt = rng.randrange(len(space.configs))
        cost = score(nxt)
        if cost < best_cost:
            best, best_cost = nxt, cost
        if cost <= cur_cost or math.isinf(cur_cost):
            accept = True
        elif math.isinf(cost):
            accept = False
        else:
            accept = rng.random() < math.exp(-(cost - cur_cost) / cur_cost / temperature(len(seen)))
        if accept:
            cur, cur_cost = nxt, cost
    return Walk(seen[best] if math.isfinite(best_cost) else None, len(seen))


ANNEALING_T0, ANNEALING_T1 = 0.2, 0.002  # relative step-time change accepted with probability 1/e
MCMC_TEMPERATURE = 0.05  # FlexFlow's fixed beta, on the relative change


def annealing(problem: Problem, *, budget: int, seed: int, solver_cfg: SolverConfig | None = None,
              micro_batch_size: int | None = None) -> Walk:
    """Simulated annealing over the planner's space, cooling geometrically over `budget` evaluations."""
    def temperature(k: int) -> float:
        return ANNEALING_T0 * (ANNEALING_T1 / ANNEALING_T0) ** (k / budget)

    return _local_search(problem, budget=budget, seed=seed, solver_cfg=solver_cfg, micro_batch_size=micro_batch_size,
                         temperature=temperature)


def mcmc(problem: Problem, *, budget: int, seed: int, solver_cfg: SolverConfig | None = None,
         micro_batch_size: int | None = None) -> Walk:
    """A Metropolis chain at a fixed temperature (FlexFlow's MCMC search) over the planner's space."""
    return _local_search(problem, budget=budget, seed=seed, solver_cfg=solver_cfg, micro_batch_size=micro_batch_size,
                         temperature=lambda k: MCMC_TEMPERATURE)


BASELINES = {"manual": manual, "flat_network": flat_network, "annealing": annealing, "mcmc": mcmc}


def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start
