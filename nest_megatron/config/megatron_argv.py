"""Megatron-LM's command-line flags, and the schema fields they set.

A Megatron launch line already says what the model is: `--num-layers 80 --hidden-size 8192 ...`.
This module reads such an argv (pure: no torch, no environment) and gives

- `scan(argv)`: every token classified, the values of the flags this project knows, and where they
  sit, so that `launch/rewrite.py` can drop the planner's flags and keep the rest in order;
- `model_overrides(argv)` / `overrides_from_argv(argv)`: Hydra overrides (`model.*`, `train.*`)
  that make `config.load.load()` build the same problem. Every model field is written, with
  Megatron's own default where the flag is absent, so nothing is inherited from another model;
- `FLAG_OF_KEY`: schema key -> the flag that sets it, to name the flag in an error.

Unknown flags pass through (Megatron-LM has hundreds, a script may add its own), except one a letter or two
away from a flag this module knows: that is a typo (`misspelt`), which Megatron-LM would reject only once
the job has its nodes. Flags that contradict each other,
or values the planner cannot price (multi-latent attention, a per-layer MoE pattern, ...), raise
one NestError line naming the flag.
"""

from __future__ import annotations

import ast
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from nest_megatron.errors import NestError

# Model-shape flags: flag -> (schema key under `model.`, value kind, Megatron's default).
# Kinds: int, float, str take one value; "list" one or more (argparse's nargs='+', read as a tuple of strings);
# "true" is a store_true flag, "false" a store_false one.
MODEL_FLAGS: dict[str, tuple[str, str, object]] = {
    "--num-layers": ("num_layers", "int", None),
    "--hidden-size": ("hidden_size", "int", None),
    "--ffn-hidden-size": ("ffn_hidden_size", "int", None),
    "--num-attention-heads": ("num_attention_heads", "int", None),
    "--num-query-groups": ("num_query_groups", "int", None),
    "--kv-channels": ("kv_channels", "int", None),
    "--seq-length": ("seq_length", "int", None),
    "--vocab-size": ("vocab_size", "int", None),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", "int", 128),
    "--padded-vocab-size": ("padded_vocab_size", "int", None),
    # A hybrid stack (arguments.py:3652 at d98e8a6; megatron-core 0.16.1's --hybrid-override-pattern, core_v0.16.1
    # arguments.py:2828, is read as it: argv_hybrid_pattern) and its Mamba mixer (TransformerConfig's mamba_* fields)
    "--hybrid-layer-pattern": ("hybrid_layer_pattern", "str", None),
    "--mamba-state-dim": ("mamba_state_dim", "int", 128),
    "--mamba-head-dim": ("mamba_head_dim", "int", 64),
    "--mamba-num-groups": ("mamba_num_groups", "int", 8),
    "--mamba-num-heads": ("mamba_num_heads", "int", None),
    "--swiglu": ("swiglu", "true", False),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", "true", False),
    "--position-embedding-type": ("position_embedding_type", "str", "learned_absolute"),
    "--normalization": ("normalization", "str", "LayerNorm"),
    "--disable-bias-linear": ("add_bias_linear", "false", True),
    "--hidden-dropout": ("hidden_dropout", "float", 0.1),
    "--attention-dropout": ("attention_dropout", "float", 0.1),
    "--attention-backend": ("attention_backend", "str", "auto"),
    "--attention-softmax-in-fp32": ("attention_softmax_in_fp32", "true", False),
    "--no-bias-swiglu-fusion": ("bias_swiglu_fusion", "false", True),
    "--num-experts": ("num_experts", "int", None),
    "--moe-router-topk": ("moe_router_topk", "int", 2),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", "int", None),
    # arguments.py:327 moe_freq_type: an integer N, or a Python list expression of 0/1 per layer ("([0]*3+[1]*58)")
    "--moe-layer-freq": ("moe_layer_freq", "str", "1"),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", "int", None),
    "--moe-shared-expert-overlap": ("moe_shared_expert_overlap", "true", False),
    # latent MoE: TransformerConfig.moe_latent_size (transformer_config.py:952 at d98e8a6; megatron-core 0.16.1
    # :719), a generated flag
    "--moe-latent-size": ("moe_latent_size", "int", None),
    # group-limited routing: TransformerConfig.moe_router_num_groups / moe_router_group_topk (transformer_config.py:
    # 780, 796), generated flags
    "--moe-router-num-groups": ("moe_router_num_groups", "int", None),
    "--moe-router-group-topk": ("moe_router_group_topk", "int", None),
    # token dropping: TransformerConfig.moe_expert_capacity_factor / moe_pad_expert_input_to_capacity
    # (transformer_config.py:917, 921 at d98e8a6), generated flags
    "--moe-expert-capacity-factor": ("moe_expert_capacity_factor", "float", None),
    "--moe-pad-expert-input-to-capacity": ("moe_pad_expert_input_to_capacity", "true", False),
    # multi-head latent attention: TransformerConfig.multi_latent_attention (transformer_config.py:288, a generated
    # store_true flag) and arguments.py:3548-3557 _add_mla_args (their defaults)
    "--multi-latent-attention": ("multi_latent_attention", "true", False),
    "--q-lora-rank": ("q_lora_rank", "int", None),
    "--kv-lora-rank": ("kv_lora_rank", "int", 32),
    "--qk-head-dim": ("qk_head_dim", "int", 128),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", "int", 64),
    "--v-head-dim": ("v_head_dim", "int", 128),
    # multi-token prediction: TransformerConfig.mtp_num_layers / mtp_loss_scaling_factor (transformer_config.py:68,
    # 75), generated flags
    "--mtp-num-layers": ("mtp_num_layers", "int", None),
    "--mtp-loss-scaling-factor": ("mtp_loss_scaling_factor", "float", 0.1),
    "--mtp-use-repeated-layer": ("mtp_use_repeated_layer", "true", False),  # transformer_config.py:82
    # arguments.py: local | transformer_engine (the default) | inference_optimized; local runs the unfused attention
    "--transformer-impl": ("transformer_impl", "str", "transformer_engine"),
    # Megatron-LM arguments.py:2448 (store_true; argument_utils.py:320-321 asserts it is not with --swiglu)
    "--squared-relu": ("squared_relu", "true", False),
    # TransformerConfig.qk_layernorm (core/transformer/transformer_config.py:259), a generated store_true flag
    "--qk-layernorm": ("qk_layernorm", "true", False),
    # arguments.py:2384: tuple_type ("left,right", -1 infinite; transformer_config.py:247-249), read by _window
    "--window-size": ("window_size", "str", None),
    # arguments.py:2387: moe_freq_type, an integer N (every N-th layer full attention) or a list pattern
    "--window-attn-skip-freq": ("window_attn_skip_freq", "str", None),
    # TransformerConfig.softmax_type (core/transformer/transformer_config.py:170), a generated flag of its Literal choices
    "--softmax-type": ("softmax_type", "str", "vanilla"),
}

# Flags read (to complete the model, or by the launch rules) that set no schema field of their own; they pass through.
HINT_FLAGS: dict[str, str] = {
    "--group-query-attention": "true",
    "--use-rotary-position-embeddings": "true",
    "--max-position-embeddings": "int",
    "--hybrid-override-pattern": "str",
    "--tokenizer-type": "str",
    "--tokenizer-model": "str",
    "--vocab-file": "str",
    "--bf16": "true",
    "--fp16": "true",
    "--no-overlap-p2p-communication": "true",  # read by launch/megatron_rules.py (interleaved schedule, pp 2)
    "--hierarchical-context-parallel-sizes": "list",  # what --cp-comm-type a2a+p2p needs (launch/megatron_rules.py)
    # what launch/megatron_rules.py reads of the grouped experts (TEGroupedMLP) and their activation offloading
    "--moe-use-legacy-grouped-gemm": "true",
    "--fine-grained-activation-offloading": "true",
    "--offload-modules": "list",
    "--optimizer": "str",  # adam or sgd, or one Megatron-FSDP does not take (launch/constraints.py)
    # FP8 (train_overrides): TransformerConfig.fp8 is the flag --fp8-format {e4m3,hybrid}, default None (no FP8), and
    # fp8_recipe --fp8-recipe {tensorwise,delayed,mxfp8,blockwise,custom}, default delayed (Megatron-LM d98e8a6
    # megatron/core/transformer/transformer_config.py:587-599; arguments.py:2373-2374 generates both from it)
    "--fp8-format": "str",
    "--fp8-recipe": "str",
    "--grad-reduce-in-bf16": "true",  # train.grad_reduce_in_bf16 (arguments.py:3053)
    "--cross-entropy-loss-fusion": "true",  # train.cross_entropy_fusion
    # train.precision_aware_optimizer and its dtypes (arguments.py:3667-3685)
    "--use-precision-aware-optimizer": "true",
    "--main-params-dtype": "str",
    "--exp-avg-dtype": "str",
    "--exp-avg-sq-dtype": "str",
    # train.cuda_graphs (cost/host.py): --cuda-graph-impl none | local | transformer_engine | full_iteration
    # (transformer_config.py:1075); the deprecated spellings read as local and transformer_engine (arguments.py:619-630)
    "--cuda-graph-impl": "str",
    "--enable-cuda-graph": "true",
    "--external-cuda-graph": "true",
    # the parts of a layer a per-layer graph captures (none named: the whole layer), which the launch rules read
    "--cuda-graph-modules": "list",
    "--cuda-graph-scope": "list",  # megatron-core 0.16.1's name of it
    # values launch/megatron_rules.py holds against the plan's sizes (d98e8a6): the eval batch and iterations
    # (training/config/training_config.py: 115, 130, 135), the attention variant (transformer_config.py:301) and
    # Gated DeltaNet's heads (:379, 382), GTP weight sharding (model_parallel_config.py:58, 135) and the bf16 end
    # layers of FP8 (transformer_config.py:652, 656)
    "--eval-micro-batch-size": "int",
    "--eval-global-batch-size": "int",
    "--eval-iters": "int",
    "--experimental-attention-variant": "str",
    "--linear-num-key-heads": "int",
    "--linear-num-value-heads": "int",
    "--tensor-parallel-num-weight-shards": "int",
    "--expert-tensor-parallel-num-weight-shards": "int",
    "--num-layers-at-start-in-bf16": "int",
    "--num-layers-at-end-in-bf16": "int",
}

# Flags the planner decides (launch/rewrite.py removes them and inserts the plan's), with their arity.
PLANNER_FLAGS: dict[str, str] = {
    "--tensor-model-parallel-size": "int",
    "--pipeline-model-parallel-size": "int",
    "--context-parallel-size": "int",
    "--expert-model-parallel-size": "int",
    "--expert-tensor-parallel-size": "int",
    "--sequence-parallel": "true",
    "--num-layers-per-virtual-pipeline-stage": "int",
    "--num-virtual-stages-per-pipeline-rank": "int",
    "--pipeline-model-parallel-layout": "str",
    "--decoder-first-pipeline-num-layers": "int",
    "--decoder-last-pipeline-num-layers": "int",
    "--account-for-embedding-in-pipeline-split": "true",
    "--account-for-loss-in-pipeline-split": "true",
    "--micro-batch-size": "int",
    "--global-batch-size": "int",
    "--use-distributed-optimizer": "true",
    "--use-megatron-fsdp": "true",
    "--data-parallel-sharding-strategy": "str",
    "--use-torch-fsdp2": "true",
    "--overlap-grad-reduce": "true",
    "--overlap-param-gather": "true",
    "--use-tp-pp-dp-mapping": "true",
    "--recompute-granularity": "str",
    "--recompute-method": "str",
    "--recompute-num-layers": "int",
    "--recompute-activations": "true",
    # selective recompute's modules (nargs='+': Megatron-LM training/argument_utils.py:146 for TransformerConfig's
    # recompute_modules list); the plan emits them when not Megatron's default [core_attn]
    "--recompute-modules": "list",
    # the experts' grouped GEMM the cost model prices (emit/megatron.py parallel_args), which the "moe_act" recompute
    # module also needs (launch/megatron_rules.py): a MoE plan adds it, and the user's stays (launch/rewrite.py)
    "--moe-grouped-gemm": "true",
    "--ckpt-format": "str",  # planner-owned only with Megatron-FSDP (fsdp_dtensor); see launch/rewrite.py
    "--init-model-with-meta-device": "true",  # with ZeRO-3 (emit/megatron.py ZERO_FLAGS)
    # MoE plans emit train.moe_dispatcher's flags, which the argv's set (Megatron's default is allgather); see
    # launch/rewrite.py
    "--moe-token-dispatcher-type": "str",
    "--moe-flex-dispatcher-backend": "str",  # with flex (train.moe_dispatcher=deepep)
    "--moe-enable-deepep": "true",  # megatron-core's deprecated spelling of the DeepEP backend
    # TP communication behind the GEMMs: the plan emits it with TP > 1 (and so sequence parallel) when
    # train.tp_comm_overlap, which the argv's own --tp-comm-overlap sets (train_overrides); Megatron-LM asserts
    # sequence parallel with it (arguments.py:1441-1442), and turns that off at TP 1 (:1433)
    "--tp-comm-overlap": "true",
    # the output layer's deferred weight gradient: emitted when train.defer_embedding_wgrad_compute, which the argv's
    # own flag sets (train_overrides); the plan then has pp > 1, which megatron-core needs with it
    "--defer-embedding-wgrad-compute": "true",
    # the distributed optimizer's partial instances: the argv's is a constraint (launch/constraints.py), so the plan's,
    # which it emits with more than one, equals it
    "--num-distributed-optimizer-instances": "int",
    # layer-level activation offloading to the host: Megatron-LM's flag for it (cpu_offloading itself is no flag,
    # arguments.py:2320; :1950-1951 turn it on for N > 0). The argv's is a constraint (launch/constraints.py), so the
    # plan's, which it emits and prices (cost/offload.py), equals it
    "--cpu-offloading-num-layers": "int",
    # the interleaved schedule's micro-batch groups (model_parallel_config.py:431-434 at d98e8a6): the argv's is a
    # constraint (launch/constraints.py), so the plan's, which it emits with virtual stages, equals it
    "--microbatch-group-size-per-virtual-pipeline-stage": "int",
    # The EP all-to-all overlap and its delayed weight gradient: the plan emits them when its configuration overlaps
    # (plan.moe_a2a_overlap, searched; the argv's flag pins it: launch/constraints.py) / train.delay_wgrad_compute,
    # which the argv's own flag sets (train_overrides); priced in cost/a2a_overlap.py
    "--overlap-moe-expert-parallel-comm": "true",
    "--delay-wgrad-compute": "true",
    # Transformer Engine's context-parallel exchange (training/arguments.py:3221, nargs='+': one for every layer, or
    # one per layer): the plan emits the one it priced with CP > 1; the argv's is a constraint
    # (launch/constraints.py), so the plan's equals it
    "--cp-comm-type": "list",
    # a hybrid stack's pattern: its '|' segments are the layer split (emit/megatron.py split_args), so the plan's
    # replaces the argv's, the same layers cut where the plan cuts them
    "--hybrid-layer-pattern": "str",
    "--hybrid-override-pattern": "str",
    # Megatron-LM's older spelling of a hybrid stack's MTP depth (arguments.py:757-785 at d98e8a6 converts it to the
    # unified pattern): read into model.mtp_hybrid_pattern, and the plan's unified pattern replaces it
    "--mtp-hybrid-override-pattern": "str",
}

KNOWN_FLAGS: dict[str, str] = {
    **{flag: kind for flag, (_, kind, _) in MODEL_FLAGS.items()},
    **HINT_FLAGS,
    **PLANNER_FLAGS,
}

# What the planner cannot price, each with why: these stop the launch instead of a silently wrong plan.
UNPLANNABLE: dict[str, str] = {
    # transformer_config.py:2690-2696: deprecated, read as group-limited routing with one group per EP rank
    "--moe-router-topk-limited-devices": "deprecated in Megatron; give --moe-router-num-groups and --moe-router-group-topk",
    "--encoder-num-layers": "encoder-decoder models are not in the cost model; use --num-layers",
    "--decoder-num-layers": "encoder-decoder models are not in the cost model; use --num-layers",
}

# Real Megatron-LM flags (main, d98e8a6) as close to a known flag as a typo would be: never called misspelt.
# tests/test_argv_typos.py checks every flag of Megatron-LM's parser against `misspelt`.
NEAR_REAL_FLAGS = frozenset({"--no-bias-gelu-fusion", "--pad-vocab-size", "--no-pad-vocab-size", "--fp4-format",
                             "--fp4-recipe", "--tp-comm-overlap-ag", "--tp-comm-overlap-rs"})
# difflib's similarity ratio 2M/(len a + len b) from which an unknown flag is taken for a known one. 0.9 is one
# wrong, missing or extra letter in a flag of 10 or more characters (`--micro-batch-sise`: 0.94), two in one
# of 20 or more, and never a short flag (`--fp8` vs `--fp16`: 0.73), where one letter makes another real
# flag. An edit distance <= 2 would call `--fp8` a typo of `--fp16`. Megatron-LM's parser has no flag at
# 0.9 or more from a known one besides NEAR_REAL_FLAGS and the --no-X / --disable-X negations.
TYPO_SIMILARITY = 0.9

# Vocabulary sizes of the tokenizers whose size is fixed by their type: GPT-2's BPE; TikTokenizer without
# --vocab-size falls back to 2**17 (megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py:24, 86).
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257, "TikTokenizer": 2**17}

FLAG_OF_KEY: dict[str, str] = {f"model.{key}": flag for flag, (key, _, _) in MODEL_FLAGS.items()}
FLAG_OF_KEY["train.global_batch_size"] = "--global-batch-size"
FLAG_OF_KEY |= {"train.precision": "--fp8-format", "train.fp8_recipe": "--fp8-recipe",
                "train.tp_comm_overlap": "--tp-comm-overlap", "train.grad_reduce_in_bf16": "--grad-reduce-in-bf16",
                "train.cross_entropy_fusion": "--cross-entropy-loss-fusion",
                "train.precision_aware_optimizer": "--use-precision-aware-optimizer",
                "train.main_params_dtype": "--main-params-dtype", "train.exp_avg_dtype": "--exp-avg-dtype",
                "train.exp_avg_sq_dtype": "--exp-avg-sq-dtype", "train.moe_dispatcher": "--moe-token-dispatcher-type",
                "train.delay_wgrad_compute": "--delay-wgrad-compute",
                "train.defer_embedding_wgrad_compute": "--defer-embedding-wgrad-compute"}
FP8_FORMATS = ("e4m3", "hybrid")  # transformer_config.py:587
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")  # transformer_config.py:1075  # :594, less custom (a quantizer of the user's code)


@dataclass
class Scanned:
    """An argv split into what this project reads and what passes through.

    `values[flag]` is the flag's last value (True for a present store_true flag); `spans` lists every
    occurrence of a known flag as (flag, start, stop) token indices, so a rewrite can drop exactly
    those tokens; everything else is left where it is.
    """

    argv: list[str]
    values: dict[str, object] = field(default_factory=dict)
    spans: list[tuple[str, int, int]] = field(default_factory=list)

    def has(self, flag: str) -> bool:
        return flag in self.values

    def get(self, flag: str, default=None):
        return self.values.get(flag, default)

    def present(self, flag: str) -> bool:
        """Whether `flag` is on the argv, also one this project does not read (it passes through: --load, ...)."""
        return any(token == flag or token.startswith(flag + "=") for token in self.argv)


def cuda_graph_impl(s: Scanned) -> str:
    """The argv's CUDA-graph implementation: --cuda-graph-impl, or the deprecated --enable-cuda-graph (local) and
    --external-cuda-graph (transformer_engine) as Megatron-LM reads them (arguments.py:619-630); 'none' without."""
    if s.has("--enable-cuda-graph"):
        return "local"
    if s.has("--external-cuda-graph"):
        return "transformer_engine"
    return s.get("--cuda-graph-impl", "none")


def misspelt(flag: str) -> str | None:
    """The known flag that `flag` is probably a typo of; None for a known flag or one far from all (it passes
    through). A --no-X / --disable-X form of a known --X is Megatron's negation of it, not a typo."""
    known = [*KNOWN_FLAGS, *UNPLANNABLE]
    if flag in KNOWN_FLAGS or flag in UNPLANNABLE or flag in NEAR_REAL_FLAGS:
        return None
    for prefix in ("--no-", "--disable-"):
        if flag.startswith(prefix) and "--" + flag[len(prefix):] in known:
            return None
    close = difflib.get_close_matches(flag, known, n=1, cutoff=TYPO_SIMILARITY)
    return close[0] if close else None


def _convert(flag: str, kind: str, text: str):
    try:
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError:
        raise NestError(f"{flag} {text}: expected {'an integer' if kind == 'int' else 'a number'}") from None


def scan(argv: list[str]) -> Scanned:
    """Classify `argv`: the known flags' values and token spans (`--flag v` and `--flag=v` forms).

    An unknown flag that is `misspelt` (a typo of a known one) is an error naming the flag it resembles.

    A known flag given twice with different values is a contradiction (argparse would silently keep
    the last one); a known flag missing its value is an error.
    """
    out = Scanned(argv=list(argv))
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if token.startswith("--") and name in UNPLANNABLE:
            raise NestError(f"{name}: {UNPLANNABLE[name]}")
        kind = KNOWN_FLAGS.get(name) if token.startswith("--") else None
        if kind is None:
            meant = misspelt(name) if token.startswith("--") else None
            if meant:
                raise NestError(f"{name}: not a Megatron flag; did you mean {meant}?")
            i += 1
            continue
        if kind in ("true", "false"):
            if eq:
                raise NestError(f"{token}: {name} takes no value")
            value, stop = True, i + 1
        elif kind == "list":  # one value after '=', else every token up to the next flag
            stop = i + 1
            while not eq and stop < len(argv) and not argv[stop].startswith("--"):
                stop += 1
            value = (inline,) if eq else tuple(argv[i + 1:stop])
            if not value or not all(value):
                raise NestError(f"{name}: expects a value")
        elif eq:
            value, stop = _convert(name, kind, inline), i + 1
        else:
            if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and argv[i + 1] != "--"):
                raise NestError(f"{name}: expects a value")
            value, stop = _convert(name, kind, argv[i + 1]), i + 2
        if name in out.values and out.values[name] != value:
            raise NestError(f"{name} is given twice with different values ({out.values[name]} and {value})")
        out.values[name] = value
        out.spans.append((name, i, stop))
        i = stop
    return out


def has_model(argv: list[str] | Scanned) -> bool:
    """Whether the argv describes a model (it has --num-layers), so the model comes from it."""
    scanned = argv if isinstance(argv, Scanned) else scan(argv)
    return scanned.has("--num-layers")


def tokenizer_vocab(s: Scanned) -> int | None:
    """The size of the tokenizer the argv builds, the vocabulary Megatron pads (None: the flags do not tell): its
    --vocab-size (which the null tokenizers and TikTokenizer take as their size, their end-of-document id inside it:
    megatron/core/tokenizers/text/libraries/null_tokenizer.py:18-19), a fixed size, a BERT vocab file or a Hugging
    Face model folder."""
    tokenizer = s.get("--tokenizer-type")
    if s.has("--vocab-size"):
        return s.get("--vocab-size")
    if tokenizer in TOKENIZER_VOCAB:
        return TOKENIZER_VOCAB[tokenizer]
    vocab_file = s.get("--vocab-file")
    if tokenizer and tokenizer.startswith("BertWordPiece") and vocab_file and Path(vocab_file).is_file():
        return sum(1 for line in Path(vocab_file).read_text().splitlines() if line)  # one token per line
    model_dir = s.get("--tokenizer-model")
    if model_dir and (Path(model_dir) / "config.json").is_file():  # a Hugging Face model folder
        size = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
        return int(size) if size else None
    return None


MAX_PATTERN = 2**14  # entries of a --moe-layer-freq list: config/load.py's MAX_LAYERS


def argv_hybrid_pattern(s: Scanned) -> str | None:
    """--hybrid-layer-pattern, or megatron-core 0.16.1's --hybrid-override-pattern (one of them: arguments.py:745-748),
    as written: its '|' segments are the layer split (parallel/layout.py PIPE)."""
    new, old = s.get("--hybrid-layer-pattern"), s.get("--hybrid-override-pattern")
    if new is not None and old is not None:
        raise NestError("--hybrid-layer-pattern and --hybrid-override-pattern: one pattern; Megatron asserts it, give "
                        "--hybrid-layer-pattern")
    pattern = new if new is not None else old
    return pattern.split(MTP_SEPARATOR)[0] if pattern is not None else None


MTP_SEPARATOR = "/"  # Megatron-LM's unified hybrid pattern: 'MAIN/DEPTH/DEPTH' (hybrid_layer_allocation.py Symbols)


def argv_mtp_depths(s: Scanned) -> tuple[str, int] | None:
    """(one depth's layers, the depths) of a hybrid stack's multi-token prediction, as Megatron-LM reads them: the
    unified pattern's parts after '/', all alike (hybrid_layer_allocation.py parse_hybrid_pattern :208-275 at d98e8a6,
    a ValueError otherwise), their count the depths whatever --mtp-num-layers says (arguments.py:864-880); or the
    older --mtp-hybrid-override-pattern, repeated --mtp-num-layers times (:774-785). None without either."""
    pattern = s.get("--hybrid-layer-pattern", s.get("--hybrid-override-pattern"))
    if pattern is not None and MTP_SEPARATOR in pattern:
        depths = [part for part in pattern.split(MTP_SEPARATOR)[1:]]
        if any(part != depths[0] for part in depths) or not depths[0]:
            raise NestError(f"--hybrid-layer-pattern {pattern}: every multi-token-prediction depth after '/' has the "
                            "same layers (Megatron-LM raises otherwise)")
        return depths[0], len(depths)
    legacy, count = s.get("--mtp-hybrid-override-pattern"), s.get("--mtp-num-layers")
    if legacy is not None and count:
        return legacy, count
    return None


def _moe_layer_freq(text: str) -> int | list[int]:
    """--moe-layer-freq as Megatron's moe_freq_type reads it (arguments.py:327): an integer N, or, when it has a
    '[', a Python list expression of lists, '+' and '*' ("([0]*3+[1]*58)"), which Megatron evaluates with eval
    after allowing only digits, commas, brackets, parentheses, '+' and '*' (arguments.py:245-253). Evaluated
    here without eval: only those operations, and at most MAX_PATTERN entries."""
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise NestError(f"--moe-layer-freq {text}: an integer N, or a list expression such as ([0]*3+[1]*58)") from None
    try:
        value = _pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise NestError(f"--moe-layer-freq {text}: {err if isinstance(err, ValueError) else 'not a list expression'}; "
                        "e.g. ([0]*3+[1]*58)") from None
    if not isinstance(value, list):
        raise NestError(f"--moe-layer-freq {text}: a list expression, e.g. ([0]*3+[1]*58)")
    return value


def _pattern(node):
    """The value of a list expression of integer literals, lists, '+' and '*'."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_pattern(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            value = left + right
        elif isinstance(node.op, ast.Mult) and {type(left), type(right)} == {list, int}:
            lst, n = (left, right) if isinstance(left, list) else (right, left)
            if len(lst) * max(n, 0) > MAX_PATTERN:
                raise ValueError(f"more than {MAX_PATTERN} entries")
            value = lst * n
        else:
            raise ValueError("only lists of integers joined by + and repeated by *")
        if isinstance(value, list) and len(value) > MAX_PATTERN:
            raise ValueError(f"more than {MAX_PATTERN} entries")
        return value
    raise ValueError("only lists of integers joined by + and repeated by *")


def _window(s: Scanned) -> tuple[int | None, int | None]:
    """(window_size, window_attn_skip_freq) from --window-size "left,right" and --window-attn-skip-freq N. The
    planner models a causal window over `left` past tokens: right 0 (a causal mask ignores the right side,
    transformer/utils.py:43-47); left -1 is the infinite window, i.e. full attention."""
    text, skip = s.get("--window-size"), s.get("--window-attn-skip-freq")
    size = None
    if text is not None:
        try:
            parts = tuple(int(i) for i in str(text).strip("()").split(","))
        except ValueError:
            parts = ()
        if len(parts) != 2 or parts[1] not in (0, -1) or parts[0] == 0 or parts[0] < -1:
            raise NestError(f"--window-size {text}: the planner models a causal sliding window, 'N,0' (N past tokens)")
        size = None if parts[0] == -1 else parts[0]
    if skip is not None:
        try:
            skip = int(skip)
        except ValueError:
            raise NestError(f"--window-attn-skip-freq {skip}: the planner models full attention every N-th layer; "
                            "give an integer N") from None
    return size, skip


def _required(s: Scanned, flag: str):
    if not s.has(flag):
        raise NestError(f"{flag}: required to describe the model (the script arguments have --num-layers but not {flag})")
    return s.get(flag)


def model_values(argv: list[str] | Scanned, *, name: str = "megatron_argv", family: str = "gpt",
                 vocab_size: int | None = None) -> dict:
    """Every ModelConfig field for the model the argv describes, Megatron's default where a flag is
    absent (`ModelConfig(**model_values(argv))` builds it). `vocab_size` is used when neither
    --vocab-size nor the tokenizer flags tell it; with neither, an error names --vocab-size."""
    s = argv if isinstance(argv, Scanned) else scan(argv)
    _required(s, "--num-attention-heads")
    hidden = _required(s, "--hidden-size")
    values = {key: (s.has(flag) if kind == "true" else not s.has(flag) if kind == "false" else s.get(flag, default))
              for flag, (key, kind, default) in MODEL_FLAGS.items()}
    values.update(num_layers=_required(s, "--num-layers"), seq_length=_required(s, "--seq-length"), name=name, family=family)
    pattern = argv_hybrid_pattern(s)
    # the model's layers, without the split's '|' (parallel/layout.py PIPE); Megatron counts the layers of the pattern
    # (arguments.py:787-797)
    values["hybrid_layer_pattern"] = pattern.replace("|", "") if pattern is not None else None
    if pattern is not None:
        values["num_layers"] = len(values["hybrid_layer_pattern"])
    values["mtp_hybrid_pattern"] = None
    mtp = argv_mtp_depths(s) if pattern is not None else None
    if mtp is not None:
        values["mtp_hybrid_pattern"], values["mtp_num_layers"] = mtp

    gqa = s.has("--group-query-attention")
    if s.has("--num-query-groups") and not gqa:
        raise NestError(
            f"--num-query-groups {s.get('--num-query-groups')} without --group-query-attention: Megatron ignores it "
            "(multi-head attention); add --group-query-attention"
        )
    # Megatron's --num-query-groups defaults to 1 (multi-query attention) under --group-query-attention.
    values["num_query_groups"] = s.get("--num-query-groups", 1) if gqa else None

    if values["ffn_hidden_size"] is None:  # Megatron's default (validate_args)
        values["ffn_hidden_size"] = int((4 * hidden * 2 / 3) / 64) * 64 if values["swiglu"] else 4 * hidden

    rotary = s.has("--use-rotary-position-embeddings")
    pos = values["position_embedding_type"]
    if rotary and s.has("--position-embedding-type") and pos != "rope":
        raise NestError(f"--use-rotary-position-embeddings and --position-embedding-type {pos}: choose one")
    if rotary or pos in ("rope", "yarn", "mrope", "none"):
        pos = "rope"  # no position-embedding parameters; the rotary variants cost the same
    elif pos != "learned_absolute":
        raise NestError(f"--position-embedding-type {pos}: the planner models learned_absolute, rope, yarn, mrope, none")
    values["position_embedding_type"] = pos

    max_pos = s.get("--max-position-embeddings")
    if max_pos is not None and max_pos < values["seq_length"]:
        raise NestError(f"--max-position-embeddings {max_pos}: must be at least --seq-length {values['seq_length']}")

    backend = values["attention_backend"]
    if backend not in ("auto", "flash", "fused", "unfused", "local"):
        raise NestError(f"--attention-backend {backend}: allowed are flash, fused, unfused, local, auto")
    # Kept as Megatron names it (flash / fused / auto run a fused kernel that keeps no s^2 tensor; unfused / local
    # keep it), but the local layer spec's DotProductAttention is the unfused one whatever the backend says.
    impl = values["transformer_impl"]
    if impl not in ("transformer_engine", "local"):
        raise NestError(f"--transformer-impl {impl}: the planner prices transformer_engine and local")
    if impl == "local" and backend not in ("unfused", "local"):
        values["attention_backend"] = "unfused"

    values["moe_layer_freq"] = _moe_layer_freq(str(values["moe_layer_freq"]))
    if values["multi_latent_attention"] and gqa:  # Megatron-LM arguments.py:1974 asserts it
        raise NestError("--multi-latent-attention and --group-query-attention: MLA has no query groups (Megatron "
                        "asserts they exclude each other); drop --group-query-attention")
    if not values["multi_latent_attention"]:
        for flag in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim"):
            if s.has(flag):
                raise NestError(f"{flag} without --multi-latent-attention: only MLA reads it")
    values["window_size"], values["window_attn_skip_freq"] = _window(s)
    if values["squared_relu"] and values["swiglu"]:  # Megatron-LM training/argument_utils.py:320-321
        raise NestError("--squared-relu and --swiglu: one MLP activation; Megatron asserts it, choose one")
    if values["num_experts"] is None:
        for flag in ("--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-latent-size"):
            if s.has(flag):
                raise NestError(f"{flag} without --num-experts: a dense model has no experts")

    size = tokenizer_vocab(s) or vocab_size or s.get("--padded-vocab-size")  # the rows bound it when nothing tells
    if size is None:
        raise NestError(
            f"--vocab-size: the vocabulary size is not known from the arguments (--tokenizer-type "
            f"{s.get('--tokenizer-type')}); add --vocab-size N or the override model.vocab_size=N"
        )
    values["vocab_size"] = size
    return values


def check_precision(argv: list[str] | Scanned, *, required: bool = True) -> None:
    """The planner prices 2-byte (bf16 / fp16) mixed-precision training: one of the two flags (or none, when
    not `required`: the model and its --bf16 then come from the plan). FP8 (--fp8-format) is on top of it:
    Megatron keeps --bf16 as the dtype of everything but the FP8 GEMMs, and accepts --fp16 with --fp8-format
    too (validate_args has no check against it), so neither changes what is required here."""
    s = argv if isinstance(argv, Scanned) else scan(argv)
    if s.has("--bf16") and s.has("--fp16"):
        raise NestError("--bf16 and --fp16: choose one")
    fmt, recipe = s.get("--fp8-format"), s.get("--fp8-recipe")
    if fmt is not None and fmt not in FP8_FORMATS:
        raise NestError(f"--fp8-format {fmt}: allowed are {', '.join(FP8_FORMATS)}")
    if recipe is not None and recipe not in FP8_RECIPES:
        raise NestError(f"--fp8-recipe {recipe}: the planner prices {', '.join(FP8_RECIPES)}")
    if required and not (s.has("--bf16") or s.has("--fp16")):
        raise NestError("no --bf16 or --fp16: the planner prices 2-byte mixed-precision training; add --bf16 (or --fp16)")


def model_overrides(argv: list[str] | Scanned, **kwargs) -> list[str]:
    """Hydra `model.*` overrides for the model the argv describes (see `model_values`); checks the precision."""
    check_precision(argv)
    return [f"model.{key}={_hydra(value)}" for key, value in model_values(argv, **kwargs).items()]


def train_overrides(argv: list[str] | Scanned) -> list[str]:
    """Hydra `train.*` overrides: the global batch, the precision (FP8 from --fp8-format, with --fp8-recipe or
    Megatron's default delayed) and the overlap options the user asked for."""
    s = argv if isinstance(argv, Scanned) else scan(argv)
    check_precision(s, required=False)
    if s.has("--overlap-param-gather") and not s.has("--overlap-grad-reduce"):
        raise NestError("--overlap-param-gather without --overlap-grad-reduce: Megatron needs both")
    out = []
    if s.has("--global-batch-size"):
        out.append(f"train.global_batch_size={s.get('--global-batch-size')}")
    out.append(f"train.overlap_grad_reduce={_hydra(s.has('--overlap-grad-reduce'))}")
    out.append(f"train.overlap_param_gather={_hydra(s.has('--overlap-param-gather'))}")
    out.append(f"train.precision={'fp8' if s.has('--fp8-format') else 'bf16'}")
    out.append(f"train.fp8_recipe={s.get('--fp8-recipe', 'delayed')}")
    out.append(f"train.tp_comm_overlap={_hydra(s.has('--tp-comm-overlap'))}")
    out.append(f"train.delay_wgrad_compute={_hydra(s.has('--delay-wgrad-compute'))}")
    out.append(f"train.defer_embedding_wgrad_compute={_hydra(s.has('--defer-embedding-wgrad-compute'))}")
    out.append(f"train.grad_reduce_in_bf16={_hydra(s.has('--grad-reduce-in-bf16'))}")
    out.append(f"train.cross_entropy_fusion={_hydra(s.has('--cross-entropy-loss-fusion'))}")
    impl = s.get("--cuda-graph-impl", "none")
    if impl not in CUDA_GRAPH_IMPLS:
        raise NestError(f"--cuda-graph-impl {impl}: allowed are {', '.join(CUDA_GRAPH_IMPLS)}")
    out.append(f"train.cuda_graphs={_hydra(cuda_graph_impl(s) != 'none')}")
    out += _dispatcher_override(s)
    out.append(f"train.precision_aware_optimizer={_hydra(s.has('--use-precision-aware-optimizer'))}")
    for flag in ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        out.append(f"train.{flag[2:].replace('-', '_')}={s.get(flag, 'fp32')}")
    return out


def _dispatcher_override(s: Scanned) -> list[str]:
    """train.moe_dispatcher from the argv's dispatcher flags (none: the planner's choice, alltoall). megatron-core
    raises for DeepEP without the flex dispatcher (transformer_config.py:1743-1745); the flex dispatcher's other
    backends are not in the cost model."""
    dispatcher = s.get("--moe-token-dispatcher-type")
    deepep = s.has("--moe-enable-deepep")
    if dispatcher is None and not deepep:
        return []
    if dispatcher != "flex":
        if deepep:
            raise NestError(f"--moe-enable-deepep with --moe-token-dispatcher-type {dispatcher or 'allgather (the default)'}: "
                            "DeepEP runs only under the flex dispatcher (Megatron raises); give --moe-token-dispatcher-type flex")
        if dispatcher not in ("alltoall", "allgather"):
            raise NestError(f"--moe-token-dispatcher-type {dispatcher}: allowed are alltoall, allgather, flex")
        return [f"train.moe_dispatcher={dispatcher}"]
    backend = "deepep" if deepep else s.get("--moe-flex-dispatcher-backend", "deepep")
    if backend != "deepep":
        raise NestError(f"--moe-flex-dispatcher-backend {backend}: the cost model prices the flex dispatcher with "
                        "DeepEP only; give deepep, or --moe-token-dispatcher-type alltoall / allgather")
    return ["train.moe_dispatcher=deepep"]


def overrides_from_argv(argv: list[str], *, name: str = "megatron_argv", family: str = "gpt",
                        vocab_size: int | None = None) -> list[str]:
    """Hydra overrides (model.*, train.*) so that `load()` builds the problem the argv describes.

    Without --num-layers the argv describes no model and only train.* overrides come back (the
    model then comes from `model=...`).
    """
    s = scan(argv)
    check_precision(s, required=has_model(s))
    model = model_overrides(s, name=name, family=family, vocab_size=vocab_size) if has_model(s) else []
    return model + train_overrides(s)


def _hydra(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(map(_hydra, value)) + "]"
    return str(value)
