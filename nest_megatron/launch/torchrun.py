"""The torchrun command of a planned launch, and running it: torchrun's agent in this process.

`nest-megatron launch` builds torchrun's flags from the devices (one agent per node, static
rendezvous: --master-addr/--master-port/--node-rank, the only one that honours a node rank);
`nest-torchrun` keeps the user's own torchrun flags as typed. Either way the agent runs here
(`torch.distributed.run.main`), so that the launch can end with the failing worker's exit status.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from nest_megatron.errors import NestError
from nest_megatron.launch.devices import Devices

TORCHRUN = "torchrun"


@dataclass(frozen=True)
class NodeCommand:
    """What one node runs: the torchrun argv and the environment it adds."""

    node_rank: int | None
    argv: list[str]
    env: dict[str, str | None] = field(default_factory=dict)  # None: removed from the environment

    def render(self) -> str:
        """As a shell line: `[env -u KEY] KEY=VALUE ... torchrun ...`."""
        unset = [f"-u {k}" for k, v in sorted(self.env.items()) if v is None]
        sets = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()) if v is not None]
        return " ".join([*(["env", *unset] if unset else []), *sets, shlex.join(self.argv)])

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = {**base, **{k: v for k, v in self.env.items() if v is not None}}
        return {k: v for k, v in env.items() if self.env.get(k, "") is not None}


def torchrun_flags(devices: Devices, *, node_rank: int | None) -> list[str]:
    """torchrun's own flags for one node of `devices`."""
    if devices.num_nodes == 1:
        # One node: torchrun picks a free local port itself.
        return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(devices.per_node)]
    if devices.master_addr is None:
        raise NestError(f"{devices.num_nodes} nodes need a rendezvous: give --master-addr (or --rdzv-endpoint HOST:PORT), "
                        "or run inside a SLURM allocation")
    flags = ["--nnodes", str(devices.num_nodes), "--nproc-per-node", str(devices.per_node)]
    if node_rank is not None:
        flags += ["--node-rank", str(node_rank)]
    return flags + ["--master-addr", devices.master_addr, "--master-port", str(devices.master_port)]


def check_script(script: str, *, module: bool = False, no_python: bool = False) -> None:
    """Refuse, before anything starts, a training script this node cannot run (torchrun would start its workers
    and dump each one's failure). Checked on the node that runs it: every node of a job calls launch itself.
    A module (-m) is Python's to find; a --no-python program is looked up as the shell would (PATH)."""
    if module:
        return
    if no_python:
        if shutil.which(script) is None:
            raise NestError(f"{script}: no such program on this node ({socket.gethostname()}), "
                            "neither a path nor on PATH (--no-python runs it as a program)")
        return
    if not os.path.isfile(script):
        raise NestError(f"{script}: no such training script on this node ({socket.gethostname()}, "
                        f"working directory {os.getcwd()})")


def node_command(flags: list[str], script: str, script_args: list[str], *, node_rank: int | None = None,
                 env: dict[str, str | None] | None = None) -> NodeCommand:
    return NodeCommand(node_rank=node_rank, argv=[TORCHRUN, *flags, script, *script_args], env=dict(env or {}))


# Status of a launch whose agent was stopped by a signal (SIGTERM from srun, scancel, a time limit): torchrun's
# own. Under srun the job's status is the highest of its tasks', so the nodes that srun stops after another
# node's worker failed must not hide that worker's status behind 128 + SIGTERM.
STOPPED_STATUS = 1


@contextmanager
def sigterm_stops_with_status(*, process_ends: bool):
    """Inside: a SIGTERM ends this process with STOPPED_STATUS, not as a signal death (128 + 15), since srun
    stops every other node when one node's launch fails and reports the highest status of its tasks. After:
    with `process_ends` (the launch is this process's command line) SIGTERM is ignored, as the status is decided
    and the process is only ending (Python would restore the default action while it finalizes); else the
    caller's handler is back (a test or a library calling the launch in its own process, whose later pool
    workers would inherit an ignored SIGTERM and outlive their terminate()). run_command lifts it while torchrun
    runs."""

    stopped = []

    def stop(signum, frame):
        if not stopped:
            print(f"nest-megatron: stopped by {signal.Signals(signum).name}; the launch exits with {STOPPED_STATUS}",
                  file=sys.stderr, flush=True)
        stopped.append(signum)
        raise SystemExit(STOPPED_STATUS)

    def swallowed(unraisable):
        # The handler ran inside code whose exceptions Python drops (an at-fork hook such as logging's, a
        # __del__): send the signal again a little later, to be handled once that code has returned.
        if stopped and isinstance(unraisable.exc_value, SystemExit):
            again = threading.Timer(0.01, os.kill, (os.getpid(), stopped[-1]))
            again.daemon = True
            again.start()
        else:
            default_unraisablehook(unraisable)

    default_unraisablehook = sys.unraisablehook
    callers = signal.signal(signal.SIGTERM, stop)
    sys.unraisablehook = swallowed
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if process_ends else callers)
        sys.unraisablehook = default_unraisablehook


def exit_status(exitcode: int) -> int:
    """A worker's Popen return code as a shell reports it: a signal death (-N) is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def run_command(command: NodeCommand) -> int:
    """Run the command's torchrun agent in this process; its status: 0, the first failing worker's exit status,
    or STOPPED_STATUS when a signal stopped the agent.

    In this process rather than exec'ed: torchrun ends with 1 whatever its workers' status, while the
    ChildFailedError its main raises carries each failure's exit code. Signals still reach the agent:
    it installs its handlers (SIGTERM, SIGINT, SIGHUP, SIGQUIT) in this main thread, stops its workers and
    raises SignalException."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torch_distributed_run
    except ImportError as err:
        raise NestError(f"cannot start torchrun: {err}; is torch installed in this environment?") from None
    environment = command.environment(dict(os.environ))
    os.environ.clear()
    os.environ.update(environment)  # torchrun's workers inherit this process's environment
    sys.stdout.flush()
    sys.stderr.flush()
    # torchrun's rendezvous waits in C++, where a Python handler would run only once it ends (minutes): SIGTERM
    # kills there, as under torchrun, until the agent installs its own handlers when it starts the workers.
    ours = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        torch_distributed_run(command.argv[1:])
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        status = exit_status(failure.exitcode)
        how = f"died of {failure.signal_name()}" if failure.exitcode < 0 else f"exited with {failure.exitcode}"
        print(err, file=sys.stderr)  # torchrun's own report of every failed worker
        print(f"nest-megatron: first failure: rank {rank} {how}; the launch exits with {status}", file=sys.stderr,
              flush=True)
        return status
    except SignalException as err:
        print(f"nest-megatron: torchrun's agent stopped on {err.sigval.name}; the launch exits with {STOPPED_STATUS}",
              file=sys.stderr, flush=True)
        return STOPPED_STATUS
    finally:
        signal.signal(signal.SIGTERM, ours)
    return 0
