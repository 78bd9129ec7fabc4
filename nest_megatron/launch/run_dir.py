"""The run directory of a launch: what ran and where its logs went, so that `nest-megatron calibrate RUN_DIR`
needs no hand work.

    RUN_DIR/plan.json                 the Plan JSON (its overrides rebuild the problem: cluster, calibration)
    RUN_DIR/run.json                  the final Megatron argv, the script, the hosts, the environment added, the digest
    RUN_DIR/logs/node<R>/command.json this node's torchrun command
    RUN_DIR/logs/node<R>/<run id>/attempt_<n>/<local rank>/stdout.log, stderr.log
                                      the workers' output, teed there by torchrun (--log-dir, --tee 3) as it goes to
                                      the console, there each line prefixed with its rank ([rank0]:)

Every node writes the same plan.json and run.json and its own logs/node<R>/; on several nodes give one --run-dir
on a shared file system, so that rank 0's arguments block and the last rank's iteration lines land together.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path

from nest_megatron.errors import NestError
from nest_megatron.launch.prepare import Prepared
from nest_megatron.launch.torchrun import NodeCommand

RUN_FILE, PLAN_FILE, LOGS = "run.json", "plan.json", "logs"
# torchrun's own options that already send the workers' output somewhere: the user's choice is kept
USER_LOG_FLAGS = ("--log-dir", "--log_dir", "--tee", "-t", "--redirects", "-r")
# torch/distributed/run.py reads it (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE; ${rank}: the global rank)
PREFIX_ENV, PREFIX = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def begin(prepared: Prepared, command: NodeCommand, folder: str | None) -> tuple[Path, NodeCommand]:
    """Write the run directory (a new temporary one without `folder`) and return it with `command` teeing the
    workers' output into it."""
    try:
        run_dir = Path(folder).absolute() if folder else Path(tempfile.mkdtemp(prefix="nest-run-"))
        node = f"node{command.node_rank if command.node_rank is not None else 0}"
        logs = run_dir / LOGS / node
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NestError(f"--run-dir {folder}: cannot create it ({err.strerror})") from None
    plan = prepared.plan
    # argv is [torchrun, *torchrun's flags, script, *script_args]: nest-torchrun's flags are the user's as typed
    flags = command.argv[1:len(command.argv) - len(prepared.script_args) - 1]
    own = any(token.split("=", 1)[0] in USER_LOG_FLAGS for token in flags)
    # torchrun prefixes each teed console line with the worker: by its global rank, as Megatron-LM names ranks,
    # unless the user chose a template
    env = {**command.env, **({} if PREFIX_ENV in os.environ else {PREFIX_ENV: PREFIX})}
    teed = command if own else NodeCommand(node_rank=command.node_rank, env=env,
                                           argv=[command.argv[0], "--log-dir", str(logs), "--tee", "3",
                                                 *command.argv[1:]])
    run = {
        "plan_digest": plan.digest,
        "script_args": list(prepared.script_args),
        "hosts": list(plan.hosts or prepared.devices.hosts),
        "num_nodes": prepared.devices.num_nodes,
        "nproc_per_node": prepared.devices.per_node,
        "logs": LOGS if not own else "(the torchrun flags' own --log-dir / --tee)",
        "started": dt.datetime.now().isoformat(timespec="seconds"),
    }
    _write(run_dir / PLAN_FILE, plan.to_json())
    _write(run_dir / RUN_FILE, json.dumps(run, indent=2))
    _write(logs / "command.json", json.dumps({"node_rank": command.node_rank, "argv": teed.argv, "env": teed.env,
                                               "command": teed.render()}, indent=2))
    return run_dir, teed
