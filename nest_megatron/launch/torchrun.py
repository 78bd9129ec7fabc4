"""The torchrun command of a planned launch, and the exec that replaces this process with it.

`nest-megatron launch` builds torchrun's flags from the devices (one agent per node, static
rendezvous: --master-addr/--master-port/--node-rank, the only one that honours a node rank);
`nest-torchrun` keeps the user's own torchrun flags as typed. Either way the process execs torchrun,
so signals reach it directly and its exit status is the job's.
"""

from __future__ import annotations

import os
import shlex
import sys
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


def node_command(flags: list[str], script: str, script_args: list[str], *, node_rank: int | None = None,
                 env: dict[str, str | None] | None = None) -> NodeCommand:
    return NodeCommand(node_rank=node_rank, argv=[TORCHRUN, *flags, script, *script_args], env=dict(env or {}))


def exec_command(command: NodeCommand) -> None:
    """Replace this process with the command (same pid: signals and the exit status are torchrun's)."""
    env = command.environment(dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command.argv[0], command.argv, env)
    except OSError as err:  # only returns on failure
        raise NestError(f"cannot start {command.argv[0]}: {err.strerror}; is torch installed in this environment?") from None
