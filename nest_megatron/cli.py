"""`nest-megatron plan|evaluate [overrides]`: one line on bad input, exit status 2, nothing written."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.errors import NestError
from nest_megatron.report.table import render

USAGE = """nest-megatron plan     [overrides] [out=PLAN.json]
nest-megatron evaluate [overrides] plan.tp=.. plan.pp=.. plan.dp=.. plan.cp=.. plan.ep=.. plan.mbs=..
                       plan.zero=0|1|2|3 plan.recompute=none|selective|full plan.vpp=.. [out=PLAN.json]

overrides are Hydra's: model=llama3_70b cluster=h100_spine_leaf cluster.num_devices=1024
train.global_batch_size=4096 model.num_layers=48 ..."""


def write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so that no half-written plan is ever left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nest-megatron", usage=USAGE)
    parser.add_argument("command", choices=["plan", "evaluate"])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--json", action="store_true", help="print the Plan JSON instead of tables")
    parser.add_argument("--quiet", action="store_true", help="print nothing; write out= only")
    args = parser.parse_intermixed_args(argv)
    console = Console(no_color=not sys.stdout.isatty() or "NO_COLOR" in os.environ)
    err = Console(stderr=True, no_color=not sys.stderr.isatty())
    try:
        loaded = load(args.overrides)
        plan = api.plan_loaded(loaded) if args.command == "plan" else api.evaluate_loaded(loaded)
        out = loaded.config.out
        if out:
            write_atomically(Path(out), plan.to_json())
    except (NestError, OSError) as e:
        err.print(f"nest-megatron {args.command}: error: {e}", highlight=False, soft_wrap=True)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    elif not args.quiet:
        render(plan, console)
        if out:
            console.print(f"plan written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
