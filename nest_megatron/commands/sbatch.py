"""`nest-megatron sbatch [overrides] [--nodes N --gpus-per-node G ...] -- SCRIPT ARGS...`: a ready sbatch script.

The launch is planned now, on the nodes asked for, so that a model that does not fit or a cluster that does not
match fails here, as one line, and no script is written; the plan goes into the script as comments and its
digest onto the launch line. At run time every node plans again under `srun nest-megatron launch
--expect-plan DIGEST`, which refuses to start a node whose plan differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path

from nest_megatron.commands.common import fail, write_atomically
from nest_megatron.commands.launch import show_changes
from nest_megatron.config.load import CONFIG_PATH_ENV, load, user_config_dirs
from nest_megatron.errors import NestError
from nest_megatron.hardware import slurm_tree
from nest_megatron.launch.devices import Devices
from nest_megatron.launch.prepare import Prepared, prepare, problem_overrides, split_keep
from nest_megatron.launch.sbatch import SbatchOptions, sbatch_script, unit_option
from nest_megatron.report.table import calibration_line

HELP = "plan a Megatron launch for N nodes and write the sbatch script that runs it (out=PATH or stdout)"
EPILOG = """example:
  nest-megatron sbatch cluster=dgx_h100_superpod --nodes 16 --partition batch --time 4:00:00 out=job.sh \\
      -- pretrain_gpt.py --num-layers 80 --hidden-size 8192 ... --bf16
  sbatch job.sh"""


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="nodes to book (required)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the node size of cluster=...)")
    parser.add_argument("--partition")
    parser.add_argument("--time", help="time limit in SLURM's form, e.g. 4:00:00 or 2-00:00:00")
    parser.add_argument("--account")
    parser.add_argument("--job-name")
    parser.add_argument("--output", help="SLURM's --output pattern, e.g. logs/%%x-%%j.out")
    parser.add_argument("--no-exclusive", action="store_true", help="omit #SBATCH --exclusive")
    parser.add_argument("--sbatch", action="append", default=None, metavar="OPTION",
                        help="one more #SBATCH option, e.g. --sbatch=--qos=high (repeatable)")
    parser.add_argument("--srun", action="append", default=None, metavar="OPTION",
                        help="one more option of the srun line, e.g. --srun=--container-image=IMAGE (repeatable)")
    parser.add_argument("--pin", help="passed to launch: keep these of the argv as plan constraints (tp,pp,...)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _options(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides and out=PATH; then -- and the training script "
                        "with its Megatron arguments")


def _plan_lines(prepared: Prepared) -> list[str]:
    plan, p = prepared.plan, prepared.plan.parallel
    lines = [f"plan when written: tp={p['tp']} pp={p['pp']} dp={p['dp']} cp={p['cp']} ep={p['ep']} vpp={p['vpp']} "
             f"mbs={plan.micro_batch_size} zero={plan.zero_stage}, peak memory "
             f"{plan.predicted['peak_memory_gib']:.1f} GiB",
             calibration_line(plan),
             f"plan digest {plan.digest} (every node must plan the same: --expect-plan)"]
    order = [c.node_rank for c in prepared.commands]
    if order != sorted(order):
        lines.append(f"node ranks by allocation order (the plan's placement): {order}")
    return lines


def launcher_path(srun_options: list[str]) -> str:
    """The running nest-megatron executable's absolute path (the console script this process was started as,
    else the one beside this Python, else the one on PATH), so that the nodes need it on no PATH; the bare name
    when none is found, or when srun starts the launch in a container (pyxis --container-image), where a path
    of the submitting host means nothing."""
    if any(option.startswith("--container-image") for option in srun_options):
        return "nest-megatron"
    candidates = [sys.argv[0] if Path(sys.argv[0]).name == "nest-megatron" else None,
                  str(Path(sys.executable).parent / "nest-megatron"), shutil.which("nest-megatron")]
    found = next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
    return os.path.abspath(found) if found else "nest-megatron"


def build(args: argparse.Namespace) -> tuple[str, str | None, Prepared, list[str]]:
    """(script text, out path or None, the launch as planned now, notes for the user): everything checked, nothing
    written."""
    if not args.script_argv:
        raise NestError("no training script: give it after --, e.g. nest-megatron sbatch --nodes 2 -- pretrain_gpt.py ARGS")
    overrides, script_argv = args.overrides, args.script_argv
    out = next((item.partition("=")[2] for item in overrides if item.startswith("out=")), None)
    forwarded = [item for item in overrides if not item.startswith("out=")]
    if args.nodes is None:
        raise NestError("--nodes is required: the number of nodes to book")
    gpus = args.gpus_per_node
    if gpus is None:  # the node size of the cluster the launch plans on
        user, _ = split_keep(forwarded)
        gpus = load(problem_overrides(script_argv[0], script_argv[1:], user)).problem.topology.devices_per_node
    options = SbatchOptions(nodes=args.nodes, gpus_per_node=gpus, job_name=args.job_name or "nest-megatron",
                            partition=args.partition, time=args.time, account=args.account, output=args.output,
                            exclusive=not args.no_exclusive, extra=list(args.sbatch or []), srun=list(args.srun or []))
    options.validate()
    # Host names are known only once SLURM allocates; the placement depends only on their order.
    devices = Devices(num_nodes=args.nodes, per_node=gpus, hosts=tuple(f"node{i}" for i in range(args.nodes)),
                      master_addr="node0", source="sbatch")
    prepared = prepare(overrides=forwarded, script=script_argv[0], script_args=script_argv[1:], devices=devices,
                       pins=args.pin.split(",") if args.pin else [])
    units, note = _units(prepared, options)
    options = dataclasses.replace(options, units=units)
    notes = [note] if note else []
    launch_options = ["--expect-plan", prepared.plan.digest] + (["--pin", args.pin] if args.pin else [])
    return sbatch_script(options, launch_options + forwarded, script_argv, plan_lines=_plan_lines(prepared),
                         launcher=launcher_path(options.srun), config_path=_config_path(), notes=notes), out, \
        prepared, notes


def _units(prepared: Prepared, options: SbatchOptions) -> tuple[str | None, str | None]:
    """The option booking whole units of the cluster's level above the host, as the plan fills them (`unit_option`),
    for the topology plugin `scontrol show topology` answers for here; (None, None) on a cluster without such a
    level (one switch, a torus)."""
    cluster = prepared.loaded.config.cluster
    above = cluster.host_level + 1
    if cluster.topology != "hierarchical" or above >= len(cluster.levels) - 1:
        return None, None  # nothing above the host but the top level, which holds the whole job
    level = cluster.levels[above]
    return unit_option(slurm_tree.from_scontrol(), nodes=options.nodes, unit_nodes=level.fan_out, unit=level.name,
                       extra=options.extra)


def _config_path() -> str | None:
    """NEST_MEGATRON_CONFIG_PATH as the plan used it (folders made absolute: the job may start elsewhere), or None
    when it is not set (or empty)."""
    if not os.environ.get(CONFIG_PATH_ENV):
        return None
    return os.pathsep.join(str(folder) for folder in user_config_dirs())


def run(args: argparse.Namespace) -> int:
    try:
        text, out, prepared, notes = build(args)
        if out:
            write_atomically(Path(out), text)
            Path(out).chmod(0o755)
    except (NestError, OSError) as err:
        return fail("sbatch", err)
    show_changes(prepared)  # what every node's launch will change in the script's arguments; after out= is written,
    # so that an out= that cannot be written stays the one line
    for note in notes:
        print(f"nest-megatron sbatch: note: {note}", file=sys.stderr)
    if out:
        print(f"sbatch script written to {out}")
    else:
        print(text, end="")
    return 0
