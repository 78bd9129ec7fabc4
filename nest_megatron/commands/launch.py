"""`nest-megatron launch [overrides] [options] -- SCRIPT ARGS...` and `nest-torchrun [torchrun flags] SCRIPT ARGS...`.

Both read the model, batch and precision from the Megatron ARGS, the devices from torchrun's flags or
SLURM, plan, rewrite the planner's flags and run torchrun's agent in this process (signals reach it
directly); the launch ends with 0 or the first failing worker's exit status (launch/torchrun.py).
Each flag of the ARGS the plan changes is listed on stderr before anything starts (launch/changes.py); what
the ARGS fix (a resume: launch/constraints.py) constrains the plan.
--dry-run prints the plan, its digest and the final command line(s) and starts nothing; so does any
error, as one line with exit status 2. --expect-plan DIGEST (written by `nest-megatron sbatch`) refuses
a node whose plan differs from the job's. --nnodes MIN:MAX plans every node count first and runs torchrun's
elastic agent, whose workers pick the plan of the nodes present after each rendezvous (launch/elastic.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nest_megatron.commands.common import fail, stdout_console
from nest_megatron.errors import NestError
from nest_megatron.launch.devices import resolve
from nest_megatron.launch.elastic import (
    AGENT_ENV,
    ELASTIC_OVERRIDES,
    check_node_keys,
    check_resumable,
    check_resume_argv,
    node_range,
    plan_sizes,
    rdzv_id,
    sized,
    torchrun_argv,
    write_cache,
)
from nest_megatron.launch.prepare import Prepared, check_digest_format, check_expected_plan, prepare
from nest_megatron.launch.run_dir import begin as begin_run_dir
from nest_megatron.launch.torchrun import NodeCommand, check_script, run_command, sigterm_stops_with_status
from nest_megatron.report.table import calibration_line, render

HELP = "plan a Megatron launch line, rewrite its parallel flags and run torchrun"
EPILOG = """examples:
  nest-megatron launch cluster=dgx_h100_superpod --nnodes 16 --nproc-per-node 8 --master-addr n1 --dry-run \\
      -- pretrain_gpt.py --num-layers 80 --hidden-size 8192 ... --bf16
  srun --ntasks-per-node=1 nest-megatron launch cluster=dgx_h100_superpod -- pretrain_gpt.py ...
  nest-megatron launch model=tiny_gpt cluster.num_devices=2 train.global_batch_size=8 --nproc-per-node 2 \
      -- scripts/pretrain_gpt.py --train-iters 5
  on each node (elastic, 2 to 4 nodes; the plan follows the nodes present):
  nest-megatron launch cluster=... --nnodes 2:4 --nproc-per-node 8 --rdzv-endpoint n1:29500 \
      -- pretrain_gpt.py ... --save ckpt --load ckpt --save-interval 100
pin what you chose by hand: --pin tp,pp (or solver.keep_user_parallelism=[tp,pp]) keeps the argv's
--tensor-model-parallel-size / --pipeline-model-parallel-size as constraints of the plan. A resume (--load or
--ckpt-format) keeps the checkpoint's format, optimizer and the sizes it cannot reshard; with --tp-comm-overlap
every TP > 1 plan has sequence parallel (the flag is dropped at TP 1). Each flag the plan changes is listed on stderr first: --flag: old -> new (why).
exit status: 0, the first failing worker's exit status (a signal death as 128 + signal), 1 when a signal
stopped the launch, 2 for bad input (nothing started)."""


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the torchrun command(s); start nothing")
    parser.add_argument("--pin", default="", help="comma-separated: keep these of the argv as plan constraints "
                        "(tp, pp, cp, ep, etp, vpp, sp, mbs, zero, recompute, order)")
    parser.add_argument("--expect-plan", metavar="DIGEST", help="refuse to start (exit 2) unless this node's plan "
                        "has this digest (nest-megatron sbatch writes it, so that every node runs the same plan)")
    torchrun = parser.add_argument_group("devices (torchrun's flags; otherwise from SLURM)")
    torchrun.add_argument("--nnodes")
    torchrun.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node")
    torchrun.add_argument("--node-rank", "--node_rank", dest="node_rank")
    torchrun.add_argument("--master-addr", "--master_addr", dest="master_addr")
    torchrun.add_argument("--master-port", "--master_port", dest="master_port")
    torchrun.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint")
    elastic = parser.add_argument_group("elastic (--nnodes MIN:MAX)")
    elastic.add_argument("--run-dir", help="where the plan, the final argv and the workers' logs are written, for "
                         "nest-megatron calibrate (elastic: the per-node-count plans; default: a new temporary directory)")
    elastic.add_argument("--max-restarts", type=int, default=3, help="torchrun's: worker-group restarts after a failure "
                         "(a lost node is one); a node joining restarts without counting (default 3)")
    elastic.add_argument("--rdzv-conf", help="torchrun's c10d rendezvous settings, e.g. last_call_timeout=5,is_host=true")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _options(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (cluster=..., model=..., "
                        "solver.keep_user_parallelism=[tp]); then -- and the training script with its Megatron arguments")


def show(prepared: Prepared, *, dry_run: bool) -> None:
    """The plan (tables) and each node's command line: on stdout for --dry-run, one line on stderr otherwise."""
    p = prepared.plan.parallel
    summary = (f"nest-megatron: tp={p['tp']} pp={p['pp']} dp={p['dp']} cp={p['cp']} ep={p['ep']} vpp={p['vpp']} "
               f"mbs={prepared.plan.micro_batch_size} zero={prepared.plan.zero_stage} on {prepared.plan.world_size} ranks, "
               f"plan {prepared.plan.digest}")
    show_changes(prepared)
    if not dry_run:
        print(summary, file=sys.stderr, flush=True)
        if prepared.plan.calibration:  # which calibration priced it (the table says it under --dry-run)
            print(f"nest-megatron: {calibration_line(prepared.plan)}", file=sys.stderr, flush=True)
        return
    console = stdout_console()
    render(prepared.plan, console, megatron_args=prepared.script_args)  # what the commands below run, not the plan's
    print(summary)
    print("\n".join(command_lines(prepared)))


def show_changes(prepared: Prepared) -> None:
    """Each flag of the argv the plan changed, on stderr before anything starts (also for --dry-run)."""
    if prepared.changes:
        print("\n".join([f"nest-megatron: the plan changes {len(prepared.changes)} flag(s) of the script's arguments:",
                         *prepared.changes]), file=sys.stderr, flush=True)


def command_lines(prepared: Prepared) -> list[str]:
    """Each node's command under a label that says whose it is. nest-torchrun's commands are the user's
    torchrun flags as typed: one command, this node's (its --node-rank), or the same on every node."""
    commands, nodes = prepared.commands, prepared.devices.num_nodes
    if len(commands) > 1 and len({c.render() for c in commands}) == 1:
        return [f"# every node ({nodes}) runs the same command:", commands[0].render()]
    lines = []
    for command in commands:
        if len(commands) > 1:
            label = f"node rank {command.node_rank}"
        elif nodes > 1 and command.node_rank is not None:
            label = f"node rank {command.node_rank} (this node; each node runs its own command)"
        else:
            label = "command"
        lines += [f"# {label}:", command.render()]
    return lines


def execute(prepared: Prepared, *, dry_run: bool, command: str, run_dir: str | None = None) -> int:
    show(prepared, dry_run=dry_run)
    if dry_run:
        return 0
    if prepared.devices.node_rank is None:
        return fail(command, f"this node's rank is unknown among {prepared.devices.num_nodes} nodes: give --node-rank "
                             "or run under srun (SLURM_NODEID)")
    if prepared.this_node is None:
        d = prepared.devices
        host = d.hosts[d.node_rank] if d.hosts else None
        why = "a failed node of the plan" if host in prepared.plan.failed_hosts else "its devices stay idle"
        print(f"nest-megatron: node {d.node_rank}{f' ({host})' if host else ''} runs no rank of this plan ({why})",
              file=sys.stderr)
        return 0
    try:
        folder, node_command = begin_run_dir(prepared, prepared.this_node, run_dir)
        print(f"nest-megatron: run directory {folder} (the plan, the argv, the workers' logs: nest-megatron calibrate "
              f"{folder})", file=sys.stderr, flush=True)
        return run_command(node_command)
    except NestError as err:  # the run directory cannot be written, torchrun could not be imported: nothing started
        return fail(command, err)


def run(args: argparse.Namespace) -> int:
    with sigterm_stops_with_status(process_ends=args.process_ends):
        return _launch(args)


def _launch(args: argparse.Namespace) -> int:
    try:
        if not args.script_argv:
            raise NestError("no training script: give it after --, e.g. nest-megatron launch cluster=... -- pretrain_gpt.py ARGS")
        if args.expect_plan is not None:
            check_digest_format(args.expect_plan)
        script, *script_args = args.script_argv
        if not args.dry_run:
            check_script(script)
        span = node_range(args.nnodes)
        if span is not None:
            return _elastic(args, script, script_args, span)
        overrides = args.overrides
        devices = resolve(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
                          master_addr=args.master_addr, master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint)
        prepared = prepare(overrides=overrides, script=script, script_args=script_args, devices=devices,
                           pins=args.pin.split(",") if args.pin else [])
        if args.expect_plan is not None:
            check_expected_plan(prepared.plan, args.expect_plan)
    except (NestError, OSError) as err:
        return fail("launch", err)
    return execute(prepared, dry_run=args.dry_run, command="launch", run_dir=args.run_dir)


@contextmanager
def without_env(name: str) -> Iterator[None]:
    """The environment variable `name` unset for the block, then as it was."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def _elastic(args: argparse.Namespace, script: str, script_args: list[str], span: tuple[int, int]) -> int:
    """--nnodes MIN:MAX: every node count planned and checked before torchrun's elastic agent starts."""
    try:
        if args.node_rank is not None or args.expect_plan is not None:
            raise NestError(f"--nnodes {args.nnodes} with {'--node-rank' if args.node_rank is not None else '--expect-plan'}: "
                            "an elastic job's rendezvous numbers the nodes in join order and runs one plan per node count")
        check_node_keys(args.overrides, args.nnodes)
        check_resume_argv(script_args, args.nnodes)
        # The rendezvous decides the node count, not the allocation: SLURM's node variables are not read.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        devices = resolve(nnodes=span[0], nproc_per_node=args.nproc_per_node, master_addr=args.master_addr,
                          master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, env=env)
        if args.master_addr is None and args.rdzv_endpoint is None:
            raise NestError(f"--nnodes {args.nnodes}: give the rendezvous, the same on every node: --rdzv-endpoint HOST:PORT")
        pins = args.pin.split(",") if args.pin else []
        # torchrun starts a worker on every device of every node present: plans that use them all.
        overrides = [*ELASTIC_OVERRIDES, *args.overrides]
        # Nor does the planner take SLURM's node list for the allocation (load() would, inside a job).
        with without_env("SLURM_JOB_NODELIST"):
            sized_plans = plan_sizes(lambda n: prepare(overrides=overrides, script=script, script_args=script_args,
                                                       devices=sized(devices, n), pins=pins), *span, args.nnodes)
        entries = [e for _, e in sized_plans]
        check_resumable(entries, script_args)
        run_dir = Path(args.run_dir or (tempfile.mkdtemp(prefix="nest-elastic-") if not args.dry_run else "RUN_DIR"))
        argv = torchrun_argv(nnodes=args.nnodes, per_node=devices.per_node, endpoint=f"{devices.master_addr}:{devices.master_port}",
                             run_id=rdzv_id(entries, script), max_restarts=args.max_restarts,
                             run_dir=run_dir if args.dry_run else run_dir.absolute(), rdzv_conf=args.rdzv_conf)
        if not args.dry_run:
            write_cache(run_dir, sized_plans, script)
    except (NestError, OSError) as err:
        return fail("launch", err)
    for prepared, e in sized_plans:
        if prepared.changes:
            print("\n".join([f"nest-megatron: on {e.nodes} node(s) the plan changes {len(prepared.changes)} flag(s) of "
                             "the script's arguments:", *prepared.changes]), file=sys.stderr, flush=True)
    out = sys.stdout if args.dry_run else sys.stderr
    print("\n".join(f"nest-megatron: elastic, {e.summary()}" for e in entries), file=out, flush=True)
    command = NodeCommand(node_rank=None, argv=argv, env=dict(AGENT_ENV))
    if args.dry_run:
        print("# every node runs the same command:\n" + command.render())
        return 0
    print(f"nest-megatron: plans for {span[0]}..{span[1]} nodes in {run_dir}", file=sys.stderr, flush=True)
    try:
        return run_command(command)
    except NestError as err:  # torchrun could not be imported: nothing started
        return fail("launch", err)


# --- nest-torchrun --------------------------------------------------------------------------------------------

TORCHRUN_DEVICE_FLAGS = ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "rdzv_endpoint")


def _leading_options(argv: list[str]) -> tuple[list[str], bool, list[str], list[str]]:
    """nest-torchrun's own leading tokens: Hydra overrides (key=value), --dry-run, --pin X; then torchrun's."""
    overrides, pins, dry_run, i = [], [], False, 0
    while i < len(argv):
        token = argv[i]
        if token == "--dry-run":
            dry_run = True
        elif token == "--pin" and i + 1 < len(argv):
            pins.append(argv[i + 1])
            i += 1
        elif token.startswith("--pin="):
            pins.append(token.partition("=")[2])
        elif not token.startswith("-") and "=" in token:
            overrides.append(token)
        else:
            break
        i += 1
    return overrides, dry_run, ",".join(pins).split(",") if pins else [], argv[i:]


def torchrun_main(argv: list[str] | None = None) -> int:
    """`nest-torchrun [overrides] [--dry-run] [--pin tp,pp] [torchrun flags] SCRIPT ARGS...`: torchrun's own
    command line, planned; torchrun's flags are kept as typed, the script's arguments are rewritten."""
    process_ends = argv is None  # the console script: this process's command line
    argv = sys.argv[1:] if argv is None else list(argv)
    with sigterm_stops_with_status(process_ends=process_ends):
        return _torchrun(argv)


def _torchrun(argv: list[str]) -> int:
    overrides, dry_run, pins, argv = _leading_options(argv)
    try:
        from torch.distributed.run import get_args_parser  # torchrun's own parser: its flags, exactly

        parser = get_args_parser()
        for action in parser._actions:
            if action.dest in TORCHRUN_DEVICE_FLAGS:
                action.default = None  # tell "given" from torchrun's default
        try:
            parsed = parser.parse_args(argv)
        except SystemExit as exit_:
            return int(exit_.code or 0) and 2
        flags = argv[: len(argv) - len(parsed.training_script_args) - 1]
        if not dry_run:
            check_script(parsed.training_script, module=parsed.module, no_python=parsed.no_python)
        devices = resolve(nnodes=parsed.nnodes, nproc_per_node=parsed.nproc_per_node, node_rank=parsed.node_rank,
                          master_addr=parsed.master_addr, master_port=parsed.master_port,
                          rdzv_endpoint=parsed.rdzv_endpoint or None, standalone=parsed.standalone)
        prepared = prepare(overrides=overrides, script=parsed.training_script, script_args=parsed.training_script_args,
                           devices=devices, pins=pins, user_torchrun_flags=flags)
    except (NestError, OSError) as err:
        return fail("torchrun", err)
    return execute(prepared, dry_run=dry_run, command="torchrun")
