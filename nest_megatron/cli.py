"""`nest-megatron COMMAND ...`: dispatch to nest_megatron.commands.<module>; one line on bad input, exit 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command name -> module under nest_megatron.commands (imported only when that command runs)
COMMANDS = {
    "plan": "plan",
    "evaluate": "plan",
    "nemo": "nemo",
    "bridge": "nemo",
    "explain": "explain",
    "launch": "launch",
    "sbatch": "sbatch",
    "trace": "trace",
    "profile": "profile",
    "sweep": "sweep",
    "calibrate": "calibrate",
}

USAGE = "nest-megatron COMMAND [overrides] [options]   (nest-megatron COMMAND --help for each)"


def command_module(name: str):
    return importlib.import_module(f"nest_megatron.commands.{COMMANDS[name]}")


class OneLineParser(argparse.ArgumentParser):
    """A bad option or value is one line on stderr and exit status 2, as every other input error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def command_parser(name: str) -> argparse.ArgumentParser:
    module = command_module(name)
    help_text = module.HELP[name] if isinstance(module.HELP, dict) else module.HELP
    parser = OneLineParser(prog=f"nest-megatron {name}", description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=getattr(module, "EPILOG", None))
    module.add_arguments(parser)
    return parser


def overview() -> str:
    lines = [f"usage: {USAGE}", "", "commands:"]
    for name in COMMANDS:
        module = command_module(name)
        lines.append(f"  {name:<10} {module.HELP[name] if isinstance(module.HELP, dict) else module.HELP}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        # argv None: the console script, whose process ends with the command (launch/torchrun.py's SIGTERM rule)
        code = dispatch(sys.argv[1:] if argv is None else list(argv), process_ends=argv is None)
        sys.stdout.flush()  # here, where a closed pipe can still be caught, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`nest-megatron plan --json | head`): no traceback; the Python docs' recipe
        # points stdout at devnull so that the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def dispatch(argv: list[str], *, process_ends: bool = False) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        print(f"nest-megatron: error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, parser = command_module(name), command_parser(name)
    # Overrides and --options mix freely before `--`; what follows it (a training script and its
    # Megatron arguments) is the command's, untouched: args.script_argv (None without `--`).
    rest = argv[1:]
    cut = rest.index("--") if "--" in rest else len(rest)
    args = parser.parse_intermixed_args(rest[:cut])
    args.script_argv = rest[cut + 1:] if cut < len(rest) else None
    args.command = name
    args.process_ends = process_ends
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
