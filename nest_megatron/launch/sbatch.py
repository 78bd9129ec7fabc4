"""A ready sbatch script: one task per node, each running `nest-megatron launch` under srun.

Every node plans again at run time from the same overrides and the same Megatron arguments (the plan is
deterministic), checks that it got the plan the script was written with (--expect-plan), takes its node
rank from the plan's placement and starts its torchrun agent; the script only books the nodes and starts
those agents. `exec srun` makes the job's exit status the training's (srun's: the highest of the nodes').

The plan is made before SLURM picks the nodes, on the cluster's levels filled in order: whole units of the level
above the host (leaf switches, NVL72 racks) first, the last one part. Inside the job each node plans on the
switches or blocks SLURM reports; nodes booked in other shares (a rack's 18 trays as 10 + 8 of two racks) plan
otherwise and start nothing. So the script asks SLURM for whole units where its topology plugin can say so
(`unit_option`).
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from dataclasses import dataclass, field

from nest_megatron.errors import NestError
from nest_megatron.hardware.slurm_tree import SwitchTree

# SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
TIME_FORMAT = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")
# a value on an #SBATCH line (a comment to bash, read by sbatch)
PLAIN_VALUE = re.compile(r"^[!-~]+$")  # printable, no blanks: a blank would end the value


@dataclass(frozen=True)
class SbatchOptions:
    nodes: int
    gpus_per_node: int
    job_name: str = "nest-megatron"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    output: str | None = None  # SLURM's --output pattern; None: SLURM's slurm-%j.out
    exclusive: bool = True
    extra: list[str] = field(default_factory=list)  # further sbatch options, e.g. --qos=high
    srun: list[str] = field(default_factory=list)  # further srun options, e.g. --container-image=nvcr.io#nvidia/pytorch
    units: str | None = None  # the option that books whole units of the level above the host (`unit_option`)

    def validate(self) -> None:
        if self.nodes < 1:
            raise NestError(f"--nodes {self.nodes}: a job needs at least one node")
        if self.gpus_per_node < 1:
            raise NestError(f"--gpus-per-node {self.gpus_per_node}: each node runs at least one GPU's process")
        for flag, value in (("--job-name", self.job_name), ("--partition", self.partition),
                            ("--account", self.account), ("--output", self.output)):
            if value is not None and not PLAIN_VALUE.match(value):
                raise NestError(f"{flag} {value!r}: one word of printable characters, no blanks or line breaks")
        if self.time is not None and not TIME_FORMAT.match(self.time):
            raise NestError(f"--time {self.time!r}: give minutes, [hours:]minutes:seconds or "
                            "days-hours[:minutes[:seconds]], e.g. 4:00:00")
        for flag, options, example in (("--sbatch", self.extra, "--qos=high"),
                                       ("--srun", self.srun, "--container-image=IMAGE")):
            for option in options:
                if not option.startswith("--") or not PLAIN_VALUE.match(option):
                    raise NestError(f"{flag} {option!r}: give one long {flag[2:]} option such as {example}")

    def directives(self) -> list[str]:
        lines = [f"--job-name={self.job_name}", f"--nodes={self.nodes}", "--ntasks-per-node=1",
                 f"--gpus-per-node={self.gpus_per_node}"]
        if self.exclusive:
            lines.append("--exclusive")
        for flag, value in (("partition", self.partition), ("time", self.time), ("account", self.account),
                            ("output", self.output)):
            if value is not None:
                lines.append(f"--{flag}={value}")
        return [f"#SBATCH {line}" for line in lines + ([self.units] if self.units else []) + list(self.extra)]


# The sbatch options that choose how the nodes spread over switches or blocks: a user's own one is kept, not added to
UNIT_OPTIONS = ("--segment", "--switches")


def unit_option(scheduler: SwitchTree | None, *, nodes: int, unit_nodes: int, unit: str,
                extra: list[str]) -> tuple[str | None, str | None]:
    """(the #SBATCH option that books `nodes` as the plan fills units of `unit_nodes` nodes, or None; a note for the
    user, or None). SLURM's Topology Guide, "User Options": the block plugin's --segment=S books segments of S nodes
    each inside one base block (the node count a multiple of S); the tree plugin's --switches=K at most K leaf
    switches. A job of one unit or less needs nothing from the block plugin, which places a job in the smallest
    block level that holds it (Topology Guide, "Block Topology"); the tree plugin takes --switches=1."""
    if nodes <= 1 or unit_nodes <= 1 or any(option.split("=")[0] in UNIT_OPTIONS for option in extra):
        return None, None
    sizes = set(Counter(scheduler.leaf_of.values()).values()) if scheduler is not None else set()
    if sizes and unit_nodes not in sizes:
        # the nodes plan on SLURM's switches or blocks, the script on the config's: they would differ
        kind = "blocks" if scheduler.blocks else "leaf switches"
        return None, (f"SLURM's {kind} hold {'/'.join(map(str, sorted(sizes)))} nodes, the cluster config's {unit} "
                      f"units {unit_nodes}: the nodes, which plan on SLURM's, would plan otherwise than this script "
                      "and start nothing (--expect-plan); set that level's fan_out to SLURM's")
    whole, part = divmod(nodes, unit_nodes)
    if part and whole:
        return None, (f"{nodes} nodes are not whole {unit} units of {unit_nodes} nodes: SLURM may book them in other "
                      f"shares than the plan's ({whole} x {unit_nodes} + {part}), and the nodes would then plan "
                      f"otherwise and start nothing (--expect-plan); book a multiple of {unit_nodes} nodes")
    block = f"--segment={unit_nodes}" if whole > 1 else None
    tree = f"--switches={max(whole, 1)}"
    if scheduler is None:
        asks = ([f"--sbatch={block} (block plugin) or "] if block else []) + [f"--sbatch={tree} (tree plugin)"]
        return None, (f"no SLURM topology answered here (scontrol show topology), so the script books {nodes} nodes "
                      f"wherever SLURM puts them; the plan fills {unit} units of {unit_nodes} nodes in order: on the "
                      f"cluster add {''.join(asks)}")
    return (block if scheduler.blocks else tree), None


def launch_command(overrides: list[str], script_argv: list[str], launcher: str = "nest-megatron") -> list[str]:
    """What srun starts on every node: the same launch line a user would type inside an allocation."""
    return [launcher, "launch", *overrides, "--", *script_argv]


def sbatch_script(options: SbatchOptions, overrides: list[str], script_argv: list[str], *,
                  plan_lines: list[str] = (), launcher: str = "nest-megatron", config_path: str | None = None,
                  notes: list[str] = ()) -> str:
    """The script text. plan_lines: the plan made when the script was written, kept as comments, and `notes` after
    them (`unit_option`'s); launcher: the
    nest-megatron executable the nodes run (an absolute path, or the bare name looked up on the nodes' PATH);
    config_path: NEST_MEGATRON_CONFIG_PATH at submit time, exported so that every node plans with the same
    configs."""
    options.validate()
    if not script_argv:
        raise NestError("no training script: give it after --, e.g. -- pretrain_gpt.py --num-layers 32 ...")
    header = ["#!/bin/bash"] + options.directives()
    comments = [
        "# Each node plans again at run time (deterministically, the same plan), takes its node rank from the",
        "# plan's placement and starts its torchrun agent; SLURM_GPUS_ON_NODE gives the processes per node.",
        "# A node whose plan differs from this one (--expect-plan) starts nothing and fails the job (exit 2).",
    ]
    # a line break inside a plan line (a calibration file's name) must not end the comment
    comments += [f"# {line}" for plan_line in plan_lines for line in plan_line.splitlines()]
    comments += [f"# note: {note}" for note in notes]
    if launcher == "nest-megatron":
        comments.append("# nest-megatron from the PATH of the nodes (or of the container): when written, none was "
                        "found as an executable, or srun runs it in a container.")
    else:
        comments.append("# nest-megatron by the path it was submitted with, so that the nodes need it on no PATH "
                        "(sbatch --export=NONE).")
    exports = []
    if config_path is not None:
        # the configs the plan was made with, also when the job's environment is not the submitter's (--export=NONE)
        exports = [f"export NEST_MEGATRON_CONFIG_PATH={shlex.quote(config_path)}", ""]
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *options.srun,
            *launch_command(overrides, script_argv, launcher)]
    return "\n".join(header + [""] + comments + [""] + exports + ["exec " + shlex.join(srun), ""])
