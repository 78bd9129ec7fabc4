"""A Megatron-LM argv -> what to trace: the model (through config/megatron_argv.py's overrides, so
that `load()` builds exactly the model a launch would plan) and the widths of the traced rank."""

from __future__ import annotations

from dataclasses import dataclass

from nest_megatron.config.megatron_argv import has_model, overrides_from_argv, scan
from nest_megatron.errors import NestError


@dataclass(frozen=True)
class Widths:
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    micro_batch_size: int = 1
    sequence_parallel: bool | None = None  # None: on with TP > 1


def split_script(argv: list[str]) -> list[str]:
    """The Megatron arguments of `[SCRIPT] ARGS...` (a leading script path is dropped)."""
    return argv[1:] if argv and not argv[0].startswith("-") else list(argv)


def from_argv(argv: list[str]) -> tuple[list[str], Widths]:
    """(Hydra overrides of the model and batch, the traced rank's widths) of a Megatron argv.

    Megatron-LM's defaults where a flag is absent: TP = EP = PP = 1, expert-TP = TP, micro-batch 1."""
    args = split_script(argv)
    if not has_model(args):
        raise NestError("the Megatron arguments describe no model: --num-layers (and --hidden-size, ...) are missing")
    s = scan(args)
    tp = s.get("--tensor-model-parallel-size", 1)
    widths = Widths(
        tp=tp,
        ep=s.get("--expert-model-parallel-size", 1),
        etp=s.get("--expert-tensor-parallel-size", tp) if s.has("--num-experts") else 1,
        pp=s.get("--pipeline-model-parallel-size", 1),
        micro_batch_size=s.get("--micro-batch-size", 1),
        sequence_parallel=s.has("--sequence-parallel") if tp > 1 else None,
    )
    return overrides_from_argv(args), widths
