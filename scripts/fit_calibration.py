"""Fit the accelerator's few free compute constants to the published, measured H100 runs.

    python scripts/fit_calibration.py [--accelerator h100_sxm] [--rounds 6]

The free constants are the cost model's physics, not per-row knobs: the fraction of the bf16 and of
the fp8 peak a large GEMM reaches (gemm_efficiency, gemm_fp8_efficiency), of the bf16 peak flash
attention reaches at head dim 128 (attention_efficiency), of the HBM bandwidth a memory-bound kernel
reaches (memory_bound_efficiency), and the fixed launch-and-tail time of a GEMM or attention kernel
(kernel_overhead_us). Everything else (peaks, bandwidths, tile shape, the network) is a datasheet or
a derivation. The fit minimises the sum of squared log errors of the predicted step time over every
calibration row priced at its published layout (scripts/bench_published.py), by coordinate descent
from the shipped values with halving steps. It prints the constants to write into
nest_megatron/hydra_configs/accelerator/<accelerator>.yaml and the errors they give.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from nest_megatron.cost.evaluate import estimate
from nest_megatron.fidelity.bench import evaluate_row, summarise
from nest_megatron.fidelity.published import rows

# accelerator field -> (first step, lower bound, upper bound)
FREE = {
    "gemm_efficiency": (0.05, 0.3, 1.0),
    "gemm_fp8_efficiency": (0.05, 0.2, 1.0),
    "attention_efficiency": (0.05, 0.1, 1.0),
    "memory_bound_efficiency": (0.1, 0.3, 1.0),
    "kernel_overhead_s": (5e-6, 0.0, 2e-4),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="coordinate-descent rounds (the step halves each)")
    args = parser.parse_args(argv)
    priced = [r for r in (evaluate_row(row) for row in rows()) if r.estimate is not None and r.refused is None]
    start = priced[0].problem.accelerator
    params = {k: getattr(start, k) for k in FREE}

    def errors(p: dict) -> list[float]:
        out = []
        for r in priced:
            problem = dataclasses.replace(r.problem, accelerator=dataclasses.replace(r.problem.accelerator, **p))
            out.append(math.log(estimate(problem, r.estimate.config).step_time / r.row.measured_step_s))
        return out

    def loss(p: dict) -> float:
        return sum(e * e for e in errors(p))

    best, steps = loss(params), {k: v[0] for k, v in FREE.items()}
    for round_ in range(args.rounds):
        for key, (_, low, high) in FREE.items():
            for direction in (1, -1):
                while True:
                    trial = dict(params, **{key: min(max(params[key] + direction * steps[key], low), high)})
                    if trial[key] == params[key] or (value := loss(trial)) >= best:
                        break
                    best, params = value, trial
        steps = {k: v / 2 for k, v in steps.items()}
        print(f"round {round_}: sum of squared log errors {best:.4f}", file=sys.stderr)

    print(f"# fitted on {len(priced)} rows of the calibration set (sum of squared log errors {best:.4f}):")
    for key, value in params.items():
        print(f"kernel_overhead_us: {value * 1e6:.1f}" if key == "kernel_overhead_s" else f"{key}: {value:.3f}")
    refit = [dataclasses.replace(r, estimate=estimate(
        dataclasses.replace(r.problem, accelerator=dataclasses.replace(r.problem.accelerator, **params)), r.estimate.config))
        for r in priced]
    print(f"# {summarise(refit).line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
