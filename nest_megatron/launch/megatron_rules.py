"""Our model of the rules Megatron-LM applies to a launch line, checked on the final argv.

Megatron-LM checks its arguments in `validate_args` (megatron/training/arguments.py) and again when
megatron-core builds its groups (`initialize_model_parallel`, `TransformerConfig.__post_init__`).
A launch that breaks one of them dies on every rank after minutes of start-up; `violations(argv,
world_size=N)` finds them first. The rules about sizes (heads and query groups vs TP, expert grid,
global batch vs micro-batch x DP, micro-batches vs stages, sequence parallel vs TP, ...) are the
planner's own (`parallel.rules.violation`), applied to the configuration the argv spells; the rules
about how flags combine are here.
"""

from __future__ import annotations

import re
from dataclasses import replace

from nest_megatron.config.megatron_argv import Scanned, model_values, scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.rules import violation

VIRTUAL_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--pipeline-model-parallel-layout")
# Megatron-FSDP sharding strategy -> the ZeRO stage it realises (emit/megatron.py ZERO_FLAGS); no_shard and
# optim count as Megatron-FSDP too, which is what the rank-order rule asks.
FSDP_ZERO = {"optim_grads": 2, "optim_grads_params": 3, "no_shard": 2, "optim": 2}
# parallel.rules names the configuration's fields; on an argv, name the flag that sets them.
FLAG_OF_FIELD = {
    "plan.tp": "--tensor-model-parallel-size",
    "plan.pp": "--pipeline-model-parallel-size",
    "plan.cp": "--context-parallel-size",
    "plan.ep": "--expert-model-parallel-size",
    "plan.etp": "--expert-tensor-parallel-size",
    "plan.vpp": "virtual pipeline stages",
    "plan.sp=true": "--sequence-parallel",
    "plan.zero": "ZeRO stage",
    "plan.order=tp-cp-ep-pp-dp": "--use-tp-pp-dp-mapping",
    "use plan.order=tp-cp-ep-dp-pp": "drop --use-tp-pp-dp-mapping",
    "plan.recompute_num_layers": "--recompute-num-layers",
    "train.global_batch_size": "--global-batch-size",
}


def layout_stages(layout: str) -> list[str]:
    """Megatron's --pipeline-model-parallel-layout unrolled into its stages ('E', 't', 'L', 'm' per layer),
    as megatron-core's PipelineParallelLayerLayout.parse_str_to_list reads it."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def _layout_problem(layout: str, *, pp: int, num_layers: int) -> str | None:
    stages = layout_stages(layout)
    flat = "".join(stages)
    flag = f"--pipeline-model-parallel-layout {layout}"
    if set(flat) - set("EtLm"):
        return f"{flag}: layers are E (embedding), t (transformer), L (loss), m (MTP); found {sorted(set(flat) - set('EtLm'))}"
    if len(stages) % pp:
        return f"{flag}: {len(stages)} stages is not a multiple of --pipeline-model-parallel-size {pp}"
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        return f"{flag}: the embedding E must come first and the loss L last, once each"
    if flat.count("t") != num_layers:
        return f"{flag}: {flat.count('t')} transformer layers, but --num-layers is {num_layers}"
    return None


def _zero(s: Scanned) -> int:
    if s.has("--use-megatron-fsdp"):
        return FSDP_ZERO[s.get("--data-parallel-sharding-strategy", "optim_grads_params")]
    return 1 if s.has("--use-distributed-optimizer") else 0


def _recompute(s: Scanned) -> tuple[str, int | None, str | None]:
    """(kind, layers recomputed per chunk or None for all, the problem with the flags or None)."""
    granularity = "selective" if s.has("--recompute-activations") else s.get("--recompute-granularity")
    method, layers = s.get("--recompute-method"), s.get("--recompute-num-layers")
    if s.has("--recompute-activations") and s.get("--recompute-granularity", "selective") != "selective":
        return "none", None, "--recompute-activations (selective) and --recompute-granularity full: choose one"
    if granularity is None:
        if method or layers is not None:
            return "none", None, "--recompute-method / --recompute-num-layers without --recompute-granularity full"
        return "none", None, None
    if granularity == "selective":
        if method or layers is not None:
            return "selective", None, "--recompute-granularity selective takes no --recompute-method / --recompute-num-layers"
        return "selective", None, None
    if granularity != "full":
        return "none", None, f"--recompute-granularity {granularity}: allowed are full, selective"
    if method not in ("uniform", "block"):
        return "full", None, "--recompute-granularity full needs --recompute-method uniform or block"
    if layers is None:
        return "full", None, "--recompute-granularity full needs --recompute-num-layers"
    # uniform recomputes every layer (in groups of n); block the first n of each chunk.
    return "full", (layers if method == "block" else None), None


def name_flags(line: str) -> str:
    """A parallel.rules line with each plan.* field replaced by the Megatron flag that sets it."""
    for name, flag in FLAG_OF_FIELD.items():
        line = line.replace(name, flag)
    return line


def violations(argv: list[str], *, world_size: int) -> list[str]:
    """Every rule the final Megatron argv breaks at `world_size` ranks, one line each ([] when it launches)."""
    s = scan(argv)
    if not s.has("--num-layers"):
        return ["--num-layers: the argv describes no model"]
    m = ModelConfig(**model_values(s, vocab_size=s.get("--vocab-size", 1)))  # the vocabulary sets no rule
    out = []
    tp = s.get("--tensor-model-parallel-size", 1)
    pp = s.get("--pipeline-model-parallel-size", 1)
    cp = s.get("--context-parallel-size", 1)
    if world_size % (tp * pp * cp):
        out.append(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    dp = max(world_size // (tp * pp * cp), 1)

    given = [f for f in VIRTUAL_FLAGS if s.has(f)]
    if len(given) > 1:
        out.append(f"{' and '.join(given)}: at most one of {', '.join(VIRTUAL_FLAGS)}")
    vpp, layers_per_stage = 1, None
    layout = s.get("--pipeline-model-parallel-layout")
    first, last = s.get("--decoder-first-pipeline-num-layers"), s.get("--decoder-last-pipeline-num-layers")
    if layout is not None:
        problem = _layout_problem(layout, pp=pp, num_layers=m.num_layers)
        if problem:
            out.append(problem)
        else:
            stages = layout_stages(layout)
            vpp = len(stages) // pp
            # Stage k of the layout runs on pipeline rank k % pp: the layers each rank holds.
            layers_per_stage = tuple(sum(stages[k].count("t") for k in range(r, len(stages), pp)) for r in range(pp))
        if first is not None or last is not None:
            out.append("--pipeline-model-parallel-layout with --decoder-first/last-pipeline-num-layers: choose one")
    elif s.has("--num-layers-per-virtual-pipeline-stage"):
        per_virtual = s.get("--num-layers-per-virtual-pipeline-stage")
        if first is not None or last is not None:
            out.append("--num-layers-per-virtual-pipeline-stage with an uneven split: use --num-virtual-stages-per-pipeline-rank")
        elif m.num_layers % pp or (m.num_layers // pp) % per_virtual:
            out.append(f"--num-layers-per-virtual-pipeline-stage {per_virtual}: must divide num_layers/pp = {m.num_layers}/{pp}")
        else:
            vpp = m.num_layers // pp // per_virtual
    elif s.has("--num-virtual-stages-per-pipeline-rank"):
        vpp = s.get("--num-virtual-stages-per-pipeline-rank")
    if first is not None or last is not None:
        middle = pp - (first is not None) - (last is not None)
        rest = m.num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle == 0 and rest) or (middle > 0 and rest % (middle * vpp)):
            out.append(f"--decoder-first/last-pipeline-num-layers: the other {rest} layers must split evenly over "
                       f"{middle} middle stages x {vpp} virtual stages")
        elif layout is None:
            ends = ([first] if first is not None else [], [last] if last is not None else [])
            layers_per_stage = (*ends[0], *[rest // middle] * middle, *ends[1]) if middle else (*ends[0], *ends[1])
    if vpp > 1 and s.has("--no-overlap-p2p-communication") and pp <= 2:
        out.append("virtual pipeline stages with --no-overlap-p2p-communication need --pipeline-model-parallel-size > 2")

    kind, recomputed, recompute_problem = _recompute(s)
    if recompute_problem:
        out.append(recompute_problem)

    if not s.has("--micro-batch-size"):
        out.append("--micro-batch-size: Megatron requires it")
    mbs = s.get("--micro-batch-size", 1)
    gbs = s.get("--global-batch-size", mbs * dp)

    fsdp = s.has("--use-megatron-fsdp")
    if s.has("--overlap-param-gather"):
        if not (s.has("--use-distributed-optimizer") or fsdp):
            out.append("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)")
        if not s.has("--overlap-grad-reduce"):
            out.append("--overlap-param-gather needs --overlap-grad-reduce")
    if fsdp and s.get("--ckpt-format") != "fsdp_dtensor":
        out.append("--use-megatron-fsdp needs --ckpt-format fsdp_dtensor")
    if s.get("--ckpt-format") == "fsdp_dtensor" and not fsdp:
        out.append("--ckpt-format fsdp_dtensor is only for --use-megatron-fsdp")
    if s.has("--data-parallel-sharding-strategy") and not fsdp:
        out.append("--data-parallel-sharding-strategy is only read with --use-megatron-fsdp")
    if s.has("--use-torch-fsdp2"):
        if pp > 1 or s.get("--expert-model-parallel-size", 1) > 1 or s.has("--use-distributed-optimizer"):
            out.append("--use-torch-fsdp2: not with pipeline or expert parallel or --use-distributed-optimizer")
    if s.has("--sequence-parallel") and tp == 1:
        out.append("--sequence-parallel needs --tensor-model-parallel-size > 1")

    cfg = ParallelConfig(
        tp=tp, pp=pp, dp=dp, cp=cp,
        ep=s.get("--expert-model-parallel-size", 1),
        etp=s.get("--expert-tensor-parallel-size", tp if m.num_experts else 1),
        vpp=vpp, sp=s.has("--sequence-parallel"), mbs=mbs,
        zero=_zero(s), recompute=kind, recompute_num_layers=recomputed,
        order="tp-cp-ep-pp-dp" if s.has("--use-tp-pp-dp-mapping") else "tp-cp-ep-dp-pp",
    )
    if layers_per_stage is not None and vpp > 1:
        # An uneven interleaved split: check the split per pipeline rank, the interleaving rules separately.
        rule = violation(replace(cfg, vpp=1), model=ModelSpec(m), num_devices=world_size, global_batch_size=gbs,
                         layers_per_stage=layers_per_stage)
        microbatches = gbs // (mbs * dp)
        if rule is None and microbatches % pp:
            rule = f"{microbatches} micro-batches: the interleaved schedule needs a multiple of pp={pp}"
    else:
        rule = violation(cfg, model=ModelSpec(m), num_devices=world_size, global_batch_size=gbs,
                         layers_per_stage=layers_per_stage)
    if rule and name_flags(rule) not in out:
        out.append(name_flags(rule))
    return out


def check(argv: list[str], *, world_size: int) -> None:
    """Raise one NestError line for the first rule the argv breaks."""
    found = violations(argv, world_size=world_size)
    if found:
        raise NestError(f"Megatron would reject the launch line: {found[0]}")
