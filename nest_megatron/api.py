"""Python entry points: the CLI's overrides in, a Plan out, no subprocess.

    from nest_megatron import api
    plan = api.plan(["model=llama3_70b", "cluster.num_devices=1024"])
    plan.predicted["step_time_s"], plan.megatron_args
"""

from __future__ import annotations

from nest_megatron.calibration.profile import shipped
from nest_megatron.config.load import Loaded, load
from nest_megatron.cost.evaluate import Estimate, uniform_split
from nest_megatron.errors import InfeasibleError, NestError
from nest_megatron.hardware.accelerator import GIB
from nest_megatron.plan import Plan, build_plan
from nest_megatron.profile.for_plan import profiled_problem
from nest_megatron.solver.dp import placed_estimate
from nest_megatron.solver.registry import SOLVERS
from nest_megatron.solver.space import evaluate_config, pinned_chunks
from nest_megatron.solver.visit import Progress


def plan(overrides: list[str]) -> Plan:
    """The fastest configuration that fits, as `nest-megatron plan` finds it."""
    return plan_loaded(load(overrides))


def evaluate(overrides: list[str]) -> Plan:
    """Score the configuration given by plan.* overrides; raise if it is invalid or does not fit."""
    return evaluate_loaded(load(overrides))


def priced_problem(loaded: Loaded):
    """The problem with the compute model that prices it, and a line saying which: a calibration profile's constants
    (config/load.py put them into the problem) on the roofline, else a profile's fitted model where the profile
    cache has one, else the shipped constants."""
    calibration = loaded.calibration
    if calibration is not None and calibration.path is not None:
        return loaded.problem, f"roofline with the constants of {calibration.label} (profiles are not used with a calibration)"
    return profiled_problem(loaded.problem, loaded.config)


def plan_loaded(loaded: Loaded, *, progress: Progress | None = None) -> Plan:
    """`progress(visited, in the space, best step time so far)` hears of the search as it goes."""
    cfg = loaded.config
    problem, compute = priced_problem(loaded)
    result = SOLVERS[cfg.solver.name](problem, cfg.solver, cfg.plan, micro_batch_size=cfg.train.micro_batch_size,
                                      progress=progress)
    if result.empty_space is not None:
        raise NestError(f"no launchable configuration: {result.empty_space}")
    if result.best is None:
        why = result.too_big or f"among {result.configs_evaluated} searched"
        raise InfeasibleError(
            f"no configuration of {cfg.model.name} fits on {problem.num_devices} x {problem.accelerator.name} "
            f"({problem.accelerator.memory_bytes / GIB:.1f} GiB): {why}; "
            "add devices, shorten model.seq_length or relax the plan.* pins"
        )
    search = {"solver": cfg.solver.name, "time_s": result.time_s, "configs_evaluated": result.configs_evaluated,
              "configs_in_space": result.configs_in_space, "compute": compute}
    chosen, others = picked(result.best, result.runners_up, cfg.plan.pick)
    if cfg.plan.pick:
        search["pick"] = cfg.plan.pick
    return build_plan(problem, chosen, model_name=cfg.model.name, cluster_name=cfg.cluster.name,
                      overrides=loaded.overrides, search=search, runners_up=others,
                      calibration=_calibration(loaded, chosen.step_time))


def picked(best: Estimate, runners_up: list[Estimate], pick: int | None) -> tuple[Estimate, list[Estimate]]:
    """(the plan plan.pick takes, the others in the search's order): the best for 0 or None, else the pick-th
    runner-up that fits."""
    if not pick:
        return best, list(runners_up)
    fitting = [e for e in runners_up if e.fits]
    if not 0 < pick <= len(fitting):
        raise NestError(f"plan.pick={pick}: give 0 (the fastest plan) or 1..{len(fitting)}, the runners-up that fit "
                        f"(the search kept {len(fitting)}; solver.top_k keeps more)")
    chosen = fitting[pick - 1]
    return chosen, [best, *(e for e in runners_up if e is not chosen)]


def evaluate_loaded(loaded: Loaded) -> Plan:
    cfg = loaded.config
    if cfg.plan.pick is not None:  # a plan of the search, the other plan.* keys its pins
        return plan_loaded(loaded)
    problem, compute = priced_problem(loaded)
    parallel = evaluate_config(problem, cfg.plan, default_mbs=cfg.train.micro_batch_size)
    split = pinned_chunks(cfg.plan, parallel, num_layers=cfg.model.num_layers)
    # under its fastest placement, as the search places a plan (evaluate of a plan's plan.* keys scores the plan)
    est = placed_estimate(problem, parallel, split or uniform_split(cfg.model.num_layers, parallel.pp))
    if est.peak_memory > est.capacity:
        worst = max(range(len(est.memory)), key=lambda i: est.memory[i].total)
        raise InfeasibleError(
            f"does not fit: stage {worst} needs {est.memory[worst].total / GIB:.1f} GiB of "
            f"{est.capacity / GIB:.1f} GiB on {problem.accelerator.name}; try plan.recompute=full, a higher "
            "plan.zero, or more plan.pp / plan.tp"
        )
    if not est.fits:  # the host memory of plan.cpu_offloading_num_layers
        raise InfeasibleError(f"does not fit: {est.shortfall} on {problem.accelerator.name}; offload fewer layers "
                              "(plan.cpu_offloading_num_layers) or give accelerator.host_memory_gib")
    return build_plan(problem, est, model_name=cfg.model.name, cluster_name=cfg.cluster.name,
                      overrides=loaded.overrides,
                      search={"solver": "evaluate", "time_s": 0.0, "configs_evaluated": 1, "compute": compute},
                      calibration=_calibration(loaded, est.step_time))


def _calibration(loaded: Loaded, step_s: float) -> dict:
    """What the Plan records of the calibration that priced it, with the band of `step_s`."""
    calibration = loaded.calibration or shipped(loaded.problem.accelerator.name)
    return calibration.to_plan(step_s)

