"""`nest-megatron trace [overrides] [options] [-- [SCRIPT] MEGATRON ARGS] out=PATH`: the model's
layer graph (per layer: kind, parameters, forward FLOPs by op class, collective bytes, saved-
activation bytes, boundary bytes) as JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from nest_megatron.commands.common import fail, stdout_console, write_atomically
from nest_megatron.config.load import load
from nest_megatron.errors import NestError

HELP = "trace the model on the meta device and write its layer graph (JSON)"
EPILOG = """\
model.source picks the model: megatron (the default here: megatron-core's GPTModel of the model.*
keys), hf (model.hf_config=PATH/config.json) or module (model.module=pkg.mod:factory). After --, a
Megatron launch line gives the model and the traced rank's widths (--tensor-model-parallel-size,
--expert-model-parallel-size, --expert-tensor-parallel-size, --sequence-parallel, --micro-batch-size).
Without out=, the JSON goes to stdout. Examples:
  nest-megatron trace model=llama3_70b --tp 8 out=llama3_70b.tp8.json
  nest-megatron trace out=g.json -- pretrain_gpt.py --num-layers 80 --hidden-size 8192 ... --bf16"""


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel width of the traced rank (default 1)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel width (MoE models; default 1)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel width (default 1; from a launch line: its value, else its TP)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages (default 1)")
    parser.add_argument("--stage", type=int, default=0, help="the pipeline stage traced, 0 .. pp-1 (default 0)")
    parser.add_argument("--no-sp", action="store_true", help="trace TP > 1 without sequence parallel (default: with)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences in the traced forward pass (default 1)")
    parser.add_argument("--layers", type=int, default=None, help="build only this many transformer layers (default: all)")
    parser.add_argument("--spec", default=None, help="megatron-core layer spec: local (default) or te (Transformer Engine)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _options(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=llama3_70b out=PATH ...); then "
                        "optionally -- and a Megatron launch line")


def check_widths(model, *, tp: int, ep: int, etp: int, micro_batch_size: int, layers: int | None) -> None:
    """One line for every width megatron-core would reject (or that makes no sense)."""
    for flag, value in (("--tp", tp), ("--ep", ep), ("--etp", etp), ("--micro-batch-size", micro_batch_size)):
        if value < 1:
            raise NestError(f"{flag}={value}: must be a positive integer")
    if layers is not None and not 1 <= layers <= model.num_layers:
        raise NestError(f"--layers={layers}: between 1 and model.num_layers={model.num_layers}")
    groups = model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % tp or groups % tp:
        raise NestError(f"--tp={tp}: must divide the attention heads ({model.num_attention_heads}) and query groups ({groups})")
    if (ep > 1 or etp > 1) and not model.num_experts:
        raise NestError(f"--ep={ep} --etp={etp}: expert parallelism needs a MoE model (model.num_experts)")
    if model.num_experts and model.num_experts % ep:
        raise NestError(f"--ep={ep}: must divide the experts ({model.num_experts})")
    if model.source == "module" and (tp, ep, etp) != (1, 1, 1):
        raise NestError("model.source=module: a generic module is traced at --tp 1 --ep 1 --etp 1 only")


def trace(args: argparse.Namespace):
    """The layer graph and where to write it."""
    from nest_megatron.trace.argv import Widths, from_argv

    overrides, megatron_args = list(args.overrides), args.script_argv or []
    widths = Widths()
    if megatron_args:
        model_overrides, widths = from_argv(megatron_args)
        overrides = model_overrides + overrides  # the user's overrides win
    if not any(o.startswith("model.source=") for o in overrides):
        overrides.append("model.source=megatron")
    # a Hugging Face config is traced as megatron-core's local spec builds it (plan prices it as Transformer Engine's)
    if "model.source=hf" in overrides and not any(o.startswith("model.transformer_impl=") for o in overrides):
        overrides.append("model.transformer_impl=local")
    loaded = load(overrides)
    model = loaded.config.model
    if model.source == "analytic":
        raise NestError("model.source=analytic: nothing to trace; use megatron, hf or module")
    tp = widths.tp if args.tp is None else args.tp
    ep = widths.ep if args.ep is None else args.ep
    etp = widths.etp if args.etp is None else args.etp
    pp = widths.pp if args.pp is None else args.pp
    mbs = widths.micro_batch_size if args.micro_batch_size is None else args.micro_batch_size
    check_widths(model, tp=tp, ep=ep, etp=etp, micro_batch_size=mbs, layers=args.layers)
    layers = args.layers or model.num_layers
    if pp < 1 or layers % pp or not 0 <= args.stage < pp:
        raise NestError(f"--pp={pp} --stage={args.stage}: pp must divide the {layers} layers traced and "
                        f"0 <= stage < pp")
    sp = False if args.no_sp else widths.sequence_parallel
    if tp > 1 and sp is not False and model.seq_length % tp:
        raise NestError(f"--tp={tp}: sequence parallel splits model.seq_length={model.seq_length} over TP; "
                        "it must divide it (or trace with --no-sp)")
    if model.source == "module" and pp > 1:
        raise NestError("model.source=module: a generic module is traced whole (--pp 1)")
    if model.source == "module":
        from nest_megatron.trace.module import trace_module

        return trace_module(model.module, seq_length=model.seq_length, name=model.name), loaded.config.out
    from nest_megatron.trace.meta import trace_megatron

    graph = trace_megatron(model, tp=tp, ep=ep, etp=etp, pp=pp, stage=args.stage, num_layers=args.layers, micro_batch_size=mbs,
                           sequence_parallel=sp, spec=args.spec or "local", source=model.source)
    return graph, loaded.config.out


def run(args: argparse.Namespace) -> int:
    try:
        graph, out = trace(args)
        if out:
            write_atomically(Path(out), graph.to_json())
    except (NestError, OSError) as e:
        return fail(args.command, e)
    if not out:
        print(graph.to_json(), end="")
        return 0
    stdout_console().print(
        f"{graph.model}: {len(graph.layers)} layers traced ({graph.source}, tp={graph.tp} ep={graph.ep} etp={graph.etp} "
        f"pp={graph.pp} stage {graph.stage} "
        f"sp={'on' if graph.sequence_parallel else 'off'}, {graph.micro_batch_size} x {graph.seq_length} tokens); "
        f"{sum(layer.params for layer in graph.layers):,} parameters on this rank; written to {out}",
        highlight=False)
    return 0
