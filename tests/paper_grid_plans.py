"""Every plan of the NEST paper grid (benchmarks/nest_paper_grid.yaml) as a launch would rewrite it.

The planner's plan for each cell (global batch 4096, micro-batch 1, as the paper) and the launchable
paper baselines (Manual / MCMC / Phaze, scored by `evaluate`), each with the Megatron argv that
`launch/rewrite.py` makes of a user's argv for it. Planned once per pytest process (cached): the
rules test and the Megatron-LM test share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nest_megatron import api
from nest_megatron.errors import InfeasibleError
from nest_megatron.launch.rewrite import model_part, rewrite
from nest_megatron.plan import Plan
from nest_megatron.solver.paper_grid import baselines, load_grid

GLOBAL_BATCH = 4096
# What a user's own argv carries besides the model: flags we do not know, and parallel flags of their own
# that the rewrite must replace.
USER_EXTRA = ["--lr", "1.0e-4", "--train-iters", "10", "--mock-data", "--tokenizer-type", "NullTokenizer",
              "--tensor-model-parallel-size", "2", "--micro-batch-size", "8", "--use-distributed-optimizer",
              "--log-interval", "1"]


@dataclass(frozen=True)
class GridPlan:
    name: str  # model/cluster/devices/solver
    plan: Plan
    argv: list[str]  # the rewritten Megatron argv

    @property
    def world_size(self) -> int:
        p = self.plan.parallel
        return p["tp"] * p["pp"] * p["cp"] * p["dp"]


def cells() -> list[tuple[str, str, int]]:
    grid = load_grid()
    devices = sorted({n for c in grid["clusters"].values() for n in c["devices_per_level"]})
    return [(m, c, n) for c in grid["clusters"] for m in grid["models"] for n in devices]


def _grid_plan(name: str, plan: Plan) -> GridPlan:
    user = model_part(plan.megatron_args) + ["--vocab-size", "32000"] + USER_EXTRA
    return GridPlan(name=name, plan=plan, argv=rewrite(user, plan))


@lru_cache(maxsize=1)
def grid_plans() -> tuple[GridPlan, ...]:
    out = []
    for model, cluster, devices in cells():
        base = [f"model={model}", f"cluster={cluster}", f"cluster.num_devices={devices}",
                f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=1"]
        out.append(_grid_plan(f"{model}/{cluster}/{devices}/dp", api.plan(base)))
        for entry in baselines(cluster=cluster, num_devices=devices, model=model, num_layers=_layers(model),
                               global_batch_size=GLOBAL_BATCH):
            if entry.overrides is None:
                continue
            try:
                plan = api.evaluate(base + entry.overrides)
            except InfeasibleError:
                continue  # launchable but out of memory: nothing to launch
            out.append(_grid_plan(f"{model}/{cluster}/{devices}/paper:{entry.name}", plan))
    return tuple(out)


def _layers(model: str) -> int:
    return load_grid()["models"][model]["num_layers"]
