"""`nest-megatron nemo|bridge [overrides] [--format cli|python]`: the plan as NeMo 2 / Megatron-Bridge overrides.

stdout is the overrides alone (a script appends them to a command); the predicted step, its band and the calibration
that priced it go to stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nest_megatron import api
from nest_megatron.commands.common import fail, write_atomically
from nest_megatron.config.load import load
from nest_megatron.errors import NestError
from nest_megatron.integrations.bridge import bridge_overrides
from nest_megatron.integrations.nemo import nemo_overrides
from nest_megatron.integrations.overrides import cli_line, hydra_literal, python_lines, python_literal
from nest_megatron.report.table import calibration_line

HELP = {
    "nemo": "plan, then print the overrides for a NeMo 2 recipe (or, with --target bridge, Megatron-Bridge)",
    "bridge": "plan, then print the overrides for a Megatron-Bridge ConfigContainer",
}

EPILOG = """\
--format cli prints one line of words to append to a nemo-run command (NeMo: Python literals, e.g.
  nemo llm pretrain --factory llama3_8b <words>) or to a Megatron-Bridge recipe script (Hydra literals).
--format python prints assignments for a recipe object; from Python, use
  nest_megatron.integrations.apply_to_recipe(recipe, plan) / apply_to_config(config, plan).
out=PATH writes the same text to PATH instead of printing it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=llama3_8b cluster.num_devices=64 ...")
    parser.add_argument("--target", choices=["nemo", "bridge"], default=None,
                        help="NeMo 2 recipe or Megatron-Bridge ConfigContainer (default: the command's name)")
    parser.add_argument("--format", choices=["cli", "python"], default="cli", dest="output_format",
                        help="nemo-run / Hydra CLI words (default) or Python assignments")


def render(plan, target: str, output_format: str, devices_per_node: int) -> str:
    if target == "nemo":
        overrides, root, literal = nemo_overrides(plan, devices_per_node), "recipe", python_literal
    else:
        overrides, root, literal = bridge_overrides(plan), "config", hydra_literal
    if output_format == "python":
        return "\n".join(python_lines(overrides, root)) + "\n"
    return cli_line(overrides, literal) + "\n"


def run(args: argparse.Namespace) -> int:
    target = args.target or args.command
    try:
        loaded = load(args.overrides)
        plan = api.plan_loaded(loaded)
        text = render(plan, target, args.output_format, loaded.problem.topology.devices_per_node)
        out = loaded.config.out
        if out:
            write_atomically(Path(out), text)
    except (NestError, OSError) as e:
        return fail(args.command, e)
    print(f"nest-megatron: {calibration_line(plan)}", file=sys.stderr, flush=True)
    if not out:
        print(text, end="")
    return 0
