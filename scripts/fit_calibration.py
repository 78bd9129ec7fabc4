"""Fit the accelerator's compute constants to the published, measured H100 runs, and cross-validate the fit.

    python scripts/fit_calibration.py [--constants NAME,...] [--no-cross-validation] [--write-shipped]
                                      [--exclude ROW,...]

The candidates are the cost model's physics, not per-row knobs (calibration/constants.py): by default the six
constants of the shipped fit (fidelity/bench.py SHIPPED_FIT), gemm_efficiency, gemm_fp8_efficiency,
attention_efficiency, memory_bound_efficiency, host_overhead_us (cost/host.py; it keeps its prior while no row is
host-bound) and all_to_all_efficiency.1 (the NIC level of dgx_h100_superpod); `--constants` names others
(kernel_overhead_us, network_efficiency.1, ...).
Everything else (peaks, bandwidths, tile shape) is a datasheet or a derivation. The fit is calibration/fit.py's,
the one `nest-megatron calibrate` runs on a user's logs: a regularised, bounded fit of the log step-time errors of
every calibration row priced at its published layout (scripts/bench_published.py), each candidate's prior centred
on its nominal size (calibration/fit.py nominal_priors: the shipped values were fitted to these same rows, and a
cross-validation fold centred on them would lean on the rows it holds out), keeping the prior of every constant
the rows do not determine.

It prints the fitted constants (for nest_megatron/hydra_configs/accelerator/<accelerator>.yaml), the in-sample
errors, the errors on Megatron-Bridge's later runs that no fit sees (scripts/bench_held_out.py's rows, less those
their release's notes call degraded), and the errors where each row is priced by a fit that did not see it:
leave-one-out, leave-one-source-out (launcher, NeMo, AutoModel, Megatron-Bridge) and leave-one-release-out (each
container tag). `--exclude` fits without the rows it names, still pricing them: what one row pulls (with
--no-cross-validation). `--write-shipped` writes the cross-validated errors of the shipped constants (the
accelerator configs' values, not the fit's) to nest_megatron/calibration/shipped/h100_sxm.yaml, whence every plan's
error band comes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import yaml

from nest_megatron.calibration.fit import cross_validation, errors_of, priors
from nest_megatron.calibration.profile import SHIPPED
from nest_megatron.fidelity.bench import SHIPPED_FIT, SHIPPED_HELD, as_runs, evaluate_row, shipped_fit
from nest_megatron.fidelity.held_out import HELD_OUT_PATH, held_out
from nest_megatron.fidelity.published import CALIBRATION_PATH, rows

# The band every plan prints: each row priced by a fit that saw no run of its framework (launcher, NeMo, AutoModel),
# as a user's runs are of a stack the shipped constants never saw
BAND_FROM = "leave-one-source-out"
ACCELERATORS = ("h100_sxm", "h200")  # the accelerator configs that hold these constants (h200: the same die)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--constants", default=",".join(SHIPPED_FIT), help="comma-separated names of the candidates")
    parser.add_argument("--no-cross-validation", action="store_true", help="the fit and its in-sample errors only")
    parser.add_argument("--write-shipped", action="store_true",
                        help=f"write the shipped constants' cross-validated errors to {SHIPPED.name}/h100_sxm.yaml")
    parser.add_argument("--exclude", default="",
                        help="comma-separated row ids the fit leaves out (still priced and reported): what a row pulls")
    args = parser.parse_args(argv)
    only = [n for n in args.constants.split(",") if n]
    start = time.perf_counter()
    excluded = [label for label in args.exclude.split(",") if label]
    if excluded and (args.write_shipped or not args.no_cross_validation):
        print("error: --exclude studies a fit: give it with --no-cross-validation and without --write-shipped",
              file=sys.stderr)
        return 2
    calibration_rows = rows()
    unknown = sorted(set(excluded) - {row.id for row in calibration_rows if not row.not_expressible})
    if unknown:  # before pricing the rows: a typo costs no wait
        print(f"error: --exclude {','.join(unknown)}: no such priced row of {CALIBRATION_PATH.name} (the row ids of "
              "docs/fidelity/published_*.md)", file=sys.stderr)
        return 2
    runs = as_runs([evaluate_row(row) for row in calibration_rows])
    prior = priors(runs)
    shipped = errors_of(tuple(run.predict(prior) for run in runs), runs)
    nominal, full = shipped_fit([run for run in runs if run.label not in excluded], only)
    print(f"# {len(runs)} rows of {CALIBRATION_PATH.name}, {time.perf_counter() - start:.0f} s"
          + (f"; the fit leaves out {', '.join(excluded)}" if excluded else ""))
    print("# fitted constants (calibration/fit.py; write the fitted ones into the accelerator config to ship them):")
    for name, verdict in full.verdicts.items():
        print(f"{name}: {verdict.value:.4g}   # prior {verdict.prior:.4g}; {verdict.why}")
    print(f"# shipped constants, in sample: {shipped.line()}")
    print(f"# the fit, in sample:           {errors_of(tuple(run.predict(full.values) for run in runs), runs).line()}")
    held = held_out_runs()
    print(f"# held out ({HELD_OUT_PATH.name}, rows no fit sees; degraded releases left out): shipped constants "
          f"{errors_of(tuple(run.predict(prior) for run in held), held).line()}; the fit "
          f"{errors_of(tuple(run.predict(full.values) for run in held), held).line()}")
    if args.no_cross_validation:
        return 0
    crossed = cross_validation(runs, full=full, prior=nominal, only=only)
    for name, errors in crossed.items():
        print(f"# {name + ':':24s}  {errors.line()}   ({time.perf_counter() - start:.0f} s)")
    if args.write_shipped:
        write_shipped(runs, prior, crossed)
    return 0


def held_out_runs() -> list:
    """Megatron-Bridge's later runs (scripts/bench_held_out.py) as the fitter's runs, without those their release's
    notes say ran degraded: what a fit is also judged by, as the runs a user will measure next."""
    return as_runs([h.result for h in held_out() if h.result is not None and not h.known_issue])


def write_shipped(runs, prior: dict, crossed: dict) -> None:
    """The cross-validated errors of the procedure that chose the shipped constants (their own fit to these rows,
    starting from them), per row, for the error band of every plan priced with them."""
    data = {
        "label": "shipped H100 calibration",
        "accelerator": "h100_sxm",
        "applies_to": list(ACCELERATORS),
        "written": f"python scripts/fit_calibration.py --write-shipped, {dt.date.today().isoformat()}",
        "rows": f"{len(runs)} rows of benchmarks/{CALIBRATION_PATH.name}",
        "constants": {k: float(v) for k, v in prior.items() if k in SHIPPED_FIT + SHIPPED_HELD},
        "band_from": BAND_FROM,
        "cross_validation": {name: {"runs": e.runs, "median_abs_error": round(e.median_abs, 5),
                                    "bias": round(e.bias, 5), "worst_abs_error": round(e.worst, 5),
                                    "rows": [run.label for run in runs],
                                    "errors": [round(x, 5) for x in e.errors]}
                             for name, e in crossed.items()},
    }
    path = SHIPPED / "h100_sxm.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text("# Generated by scripts/fit_calibration.py --write-shipped; tests/test_calibration.py checks its\n"
                    "# constants against the accelerator config (regenerate after a refit).\n"
                    + yaml.safe_dump(data, sort_keys=False, width=120))
    print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


if __name__ == "__main__":
    sys.exit(main())
