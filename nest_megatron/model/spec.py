"""A transformer's shape and the numbers derived from it: parameters and GEMMs per layer.

Counts follow megatron-core's GPTModel with the layer specs Megatron-LM uses (ColumnParallelLinear
for QKV and FC1, RowParallelLinear for the projection and FC2, vocab-parallel embedding and output
layer), so that per-rank parameter counts match a model built on the meta device exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from nest_megatron.config.schema import ModelConfig
from nest_megatron.model.kinds import HYBRID_KINDS, LayerKind
from nest_megatron.model.layer_graph import LayerGraph, LayerTrace

# Megatron's --attention-backend values (megatron/core/transformer/enums.py AttnBackend), and those that run a
# fused kernel keeping no s x s tensor: auto lets Transformer Engine pick cuDNN's fused attention or flash-attn.
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
FUSED_ATTENTION_BACKENDS = ("auto", "flash", "fused")
# megatron-core's softmax_type values (transformer/transformer_config.py:170): the softmax, with a zero logit added
# to each row (off-by-one), or a learnt per-head one (learnable).
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# MambaMixer's constructor defaults, which no Megatron flag changes (megatron-core 0.16.1 ssm/mamba_mixer.py:149-151)
MAMBA_CONV_KERNEL = 4  # d_conv
MAMBA_EXPAND = 2  # d_inner = expand x hidden_size, without mamba_num_heads


@dataclass(frozen=True)
class Gemm:
    """One GEMM of a layer's forward pass on one device: [m, k] @ [k, n]."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1  # identical GEMMs of one kernel launch each (a grouped GEMM's local experts)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def dgrad(self) -> Gemm:
        """The backward input-gradient GEMM: [m, n] @ [n, k]."""
        return Gemm(f"{self.name}_dgrad", self.m, self.k, self.n, self.count)

    @property
    def wgrad(self) -> Gemm:
        """The backward weight-gradient GEMM: [k, m] @ [m, n]."""
        return Gemm(f"{self.name}_wgrad", self.k, self.n, self.m, self.count)


@dataclass(frozen=True)
class Numerics:
    """The datatypes the model trains in, from the train.* keys: what its GEMMs, gradients and loss
    cost and keep."""

    fp8_recipe: str | None = None  # GEMMs in fp8 with this recipe (train.precision=fp8); None: bf16
    # The accelerator's FP8 GEMMs take any operand layout (accelerator.fp8_gemm_any_layout, Blackwell): a per-tensor
    # recipe keeps one FP8 copy of a tensor, not a copy and its transpose (cost/fp8.py).
    fp8_any_layout: bool = False
    grad_reduce_in_bf16: bool = False  # main gradients and their data-parallel reduction in bf16, not fp32
    cross_entropy_fusion: bool = False  # the fused cross entropy: neither fp32 logits nor a softmax kept
    # The precision-aware optimizer (--use-precision-aware-optimizer) and its state's dtypes; None: Megatron's
    # fp32 master weights and moments.
    optimizer_dtypes: OptimizerDtypes | None = None

    @property
    def grad_bytes(self) -> int:
        return 2 if self.grad_reduce_in_bf16 else 4

    @property
    def optimizer_state_bytes(self) -> float:
        """Bytes of optimizer state per parameter: the master weight and Adam's two moments.

        Megatron's optimizers keep fp32 ones: 12. The precision-aware optimizer (Megatron-LM d98e8a6
        megatron/core/optimizer/__init__.py:564-588) hands them to Transformer Engine's FusedAdam in the dtypes
        given. An fp16 master is 2 bytes. An fp32 master is kept by FusedAdam, as the 16 bits the bf16 weight
        lacks (store_param_remainders, on by default: optimizer_config.py:192), 2 bytes, unless an fp8 recipe
        other than delayed scaling makes Megatron keep its own fp32 master (optimizer_config.py:407-413), 4 bytes.
        """
        d = self.optimizer_dtypes
        if d is None:
            return 12
        if d.main_params == "fp32":
            master = 2 if self.fp8_recipe in (None, "delayed") else 4
        else:
            master = MASTER_BYTES[d.main_params]
        return master + DTYPE_BYTES[d.exp_avg] + DTYPE_BYTES[d.exp_avg_sq]


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
# A master weight other than fp32: fp16 (--main-params-dtype fp16), or none, the bf16 weight itself (NeMo 1.x's Apex
# DistributedFusedAdam with optim.dtype bf16, which no Megatron-LM flag selects: the fidelity bench's rows).
MASTER_BYTES = {"fp16": 2, "none": 0}


@dataclass(frozen=True)
class OptimizerDtypes:
    """The precision-aware optimizer's state dtypes (--main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype)."""

    main_params: str = "fp32"  # fp32 | fp16 | none (MASTER_BYTES)
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"

    @property
    def megatron(self) -> bool:
        """Whether Megatron's precision-aware optimizer keeps this state: it always has a master weight of its own.
        None (the bf16 weight is the master) is another framework's optimizer that no Megatron flag selects, which
        the fidelity bench prices (NeMo 1.x's Apex DistributedFusedAdam, PyTorch's Adam on bf16 parameters)."""
        return self.main_params != "none"


@dataclass(frozen=True, eq=False)  # hashed by identity: per-layer costs are cached per model
class ModelSpec:
    cfg: ModelConfig
    # A traced model (model.source=megatron|module, or hf with transformer_impl=local): tracer(tp, ep, etp) is this rank's layer
    # graph at one sequence, or None where the source cannot trace that width. Its per-layer-kind
    # parameters, GEMMs, attention FLOPs and saved bytes replace the analytic ones (`traced_layer`).
    tracer: Callable[[int, int, int], LayerGraph | None] | None = field(default=None, repr=False)
    numerics: Numerics = field(default_factory=lambda: Numerics())

    def traced_layer(self, *, tp: int, ep: int = 1, etp: int = 1,
                     kind: LayerKind | None = None) -> tuple[LayerGraph, LayerTrace] | None:
        """The traced graph at (tp, ep, etp) and its first layer of `kind` (default: `default_kind`), or None
        (analytic)."""
        if self.tracer is None:
            return None
        graph = _traced_graph(self, tp, ep if self.is_moe else 1, etp if self.is_moe else 1)
        if graph is None:
            return None
        kind = kind or self.default_kind
        layer = graph.first_of_kind(kind.label) or graph.first_of_kind("block")
        return (graph, layer) if layer is not None else None

    # --- shape -----------------------------------------------------------------------------
    @property
    def h(self) -> int:
        return self.cfg.hidden_size

    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.cfg.num_query_groups or self.cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.kv_channels or self.cfg.hidden_size // self.cfg.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.query_groups * self.head_dim

    @property
    def fused_attention(self) -> bool:
        """Whether attention runs a fused kernel (model.attention_backend auto, flash or fused)."""
        return self.cfg.attention_backend in FUSED_ATTENTION_BACKENDS

    @cached_property  # asked of every configuration the search judges
    def is_moe(self) -> bool:
        return bool(self.cfg.num_experts)

    @property
    def is_gpt_model(self) -> bool:
        """Whether Megatron builds it as a GPTModel (not a hybrid Mamba stack, not BERT)."""
        return gpt_model(self.cfg)

    @property
    def mixer(self) -> str:
        """The decoder's mixer: mla with --multi-latent-attention, attention otherwise."""
        return "mla" if self.cfg.multi_latent_attention else "attention"

    @cached_property
    def moe_pattern(self) -> tuple[bool, ...]:
        """Per decoder layer, whether its MLP is MoE: Megatron's --moe-layer-freq, an integer N (layer i when
        i % N == 0) or a list of 0 / 1 per layer (megatron/core/transformer/moe/moe_utils.py
        get_moe_layer_wise_logging_tracker's pattern, gpt_layer_specs.py get_gpt_decoder_layer_specs)."""
        freq, n = self.cfg.moe_layer_freq, self.cfg.num_layers
        if not self.is_moe:
            return (False,) * n
        if isinstance(freq, int):
            return tuple(i % freq == 0 for i in range(n))
        return tuple(bool(x) for x in freq)

    @cached_property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The kind of every decoder layer, in order: a hybrid pattern's symbol each (HYBRID_KINDS), else the
        mixer with the MLP --moe-layer-freq gives it."""
        if self.cfg.hybrid_layer_pattern:
            return tuple(HYBRID_KINDS[symbol] for symbol in self.cfg.hybrid_layer_pattern)
        return tuple(LayerKind(self.mixer, "moe" if moe else "dense") for moe in self.moe_pattern)

    @cached_property
    def kinds(self) -> tuple[LayerKind, ...]:
        """The distinct kinds of `layer_kinds`, in order of first appearance."""
        return tuple(self.kind_counts)

    @cached_property
    def kind_index(self):
        """Per decoder layer, the position of its kind in `kinds` (a numpy array, for the cost tables)."""
        import numpy as np

        index = {kind: i for i, kind in enumerate(self.kinds)}
        return np.fromiter((index[kind] for kind in self.layer_kinds), dtype=int, count=len(self.layer_kinds))

    @cached_property
    def kind_counts(self) -> dict[LayerKind, int]:
        """How many decoder layers each kind has, in order of first appearance."""
        return dict(Counter(self.layer_kinds))

    @property
    def default_kind(self) -> LayerKind:
        """The kind a caller means without naming one: the model's mixer with a MoE MLP when the model has
        experts, a dense one otherwise."""
        return LayerKind(self.mixer, "moe" if self.is_moe else "dense")

    @property
    def mtp_depths(self) -> int:
        """Multi-token-prediction depths run: each runs its layers, and the output layer once more."""
        return self.cfg.mtp_num_layers or 0

    @property
    def mtp_physical_depths(self) -> int:
        """Depths whose layers hold parameters: one when a repeated layer serves every depth."""
        return min(1, self.mtp_depths) if self.cfg.mtp_use_repeated_layer else self.mtp_depths

    @cached_property
    def mtp_depth_kinds(self) -> tuple[LayerKind, ...]:
        """The layers of one multi-token-prediction depth, the first with the depth's own norms and projection
        (`mtp` set): a GPT stack's is the decoder's last layer (megatron-core's MTP block spec takes the decoder
        block spec's last layer, gpt_layer_specs.py get_gpt_mtp_block_spec_for_backend), a hybrid stack's its
        model.mtp_hybrid_pattern; none without --mtp-num-layers."""
        if not self.mtp_depths:
            return ()
        kinds = ([HYBRID_KINDS[symbol] for symbol in self.cfg.mtp_hybrid_pattern] if self.cfg.mtp_hybrid_pattern
                 else [self.layer_kinds[-1]])
        first = kinds[0]
        return (LayerKind(first.mixer, first.mlp, mtp=True), *kinds[1:])

    @property
    def moe_ffn(self) -> int:
        return self.cfg.moe_ffn_hidden_size or self.cfg.ffn_hidden_size

    @property
    def moe_token_width(self) -> int:
        """The width of the tokens a MoE layer routes: its latent size with --moe-latent-size (fc1_latent_proj
        projects h -> latent before the dispatch, megatron-core 0.16.1 moe/moe_layer.py:264-270; the experts read and
        write that width, experts.py:540-570; the combine returns it to fc2_latent_proj, :339-345), else hidden_size."""
        return self.cfg.moe_latent_size or self.h

    @property
    def fc1_factor(self) -> int:
        """FC1 produces gate and up projections with SwiGLU."""
        return 2 if self.cfg.swiglu else 1

    # --- the Mamba-2 mixer (megatron-core 0.16.1 ssm/mamba_mixer.py MambaMixer: d_conv 4, expand 2) ------------
    @cached_property  # asked by the Mamba rules of every configuration the search judges
    def has_mamba(self) -> bool:
        return any(kind.mixer == "mamba" for kind in self.kinds)

    @property
    def mamba_heads(self) -> int:
        """Its heads: mamba_num_heads, else expand x h / head_dim (mamba_mixer.py:233-239)."""
        return self.cfg.mamba_num_heads or MAMBA_EXPAND * self.h // self.cfg.mamba_head_dim

    @property
    def mamba_inner(self) -> int:
        """d_inner, the width the scan runs at: heads x head_dim."""
        return self.mamba_heads * self.cfg.mamba_head_dim

    @property
    def mamba_in_proj_width(self) -> int:
        """in_proj's output, z x B C dt: 2 d_inner + 2 groups x state + heads (mamba_mixer.py:268-271)."""
        m = self.cfg
        return 2 * self.mamba_inner + 2 * m.mamba_num_groups * m.mamba_state_dim + self.mamba_heads

    @property
    def mamba_conv_width(self) -> int:
        """The causal conv1d's channels, x B C: d_inner + 2 groups x state (mamba_mixer.py:292)."""
        return self.mamba_inner + 2 * self.cfg.mamba_num_groups * self.cfg.mamba_state_dim

    def mamba_params(self, tp: int) -> int:
        """MambaMixer's parameters on one TP rank, and the input norm TE fuses into in_proj: in_proj
        (column-parallel), the depthwise conv1d's weights (d_conv a channel) and biases, dt_bias, A_log and D (one
        a head), the gated RMSNorm (d_inner) and out_proj (row-parallel, no bias: mamba_mixer.py:264), all split
        over TP (:268-379)."""
        h = self.h
        conv = self.mamba_conv_width // tp * (MAMBA_CONV_KERNEL + 1)
        per_head = 3 * self.mamba_heads // tp  # dt_bias, A_log, D
        inner = self.mamba_inner // tp
        return h * self.mamba_in_proj_width // tp + conv + per_head + inner + inner * h + self.norm_params

    @property
    def norm_params(self) -> int:
        return self.h * (2 if self.cfg.normalization == "LayerNorm" else 1)

    def padded_vocab(self, tp: int) -> int:
        """The embedding's rows: --padded-vocab-size as given, else Megatron pads the vocabulary to a multiple of
        make_vocab_size_divisible_by * tp (megatron/core/tokenizers/utils/build_tokenizer.py:133-152;
        megatron/training/argument_utils.py:474-476)."""
        if self.cfg.padded_vocab_size:
            return self.cfg.padded_vocab_size
        multiple = self.cfg.make_vocab_size_divisible_by * tp
        return math.ceil(self.cfg.vocab_size / multiple) * multiple

    # --- multi-head latent attention: the widths (megatron/core/transformer/multi_latent_attention.py) -------
    @property
    def mla_qk_head_dim(self) -> int:
        """A query's and a key's width per head: the no-RoPE part and the decoupled RoPE part."""
        return self.cfg.qk_head_dim + self.cfg.qk_pos_emb_head_dim

    @property
    def mla_kv_down_width(self) -> int:
        """linear_kv_down_proj's output: the KV latent and the one RoPE key shared by all heads."""
        return self.cfg.kv_lora_rank + self.cfg.qk_pos_emb_head_dim

    @property
    def mla_down_split(self) -> bool:
        """Whether MLA's down projections are split over TP: Transformer Engine's layer spec duplicates them on
        every rank (TELinear parallel_mode='duplicated', gpt_layer_specs.py
        get_gpt_layer_with_transformer_engine_spec); the local spec makes them column-parallel."""
        return self.cfg.transformer_impl == "local"

    def attention_widths(self, kind: LayerKind) -> tuple[int, int]:
        """(query/key width, value width) over all heads of the mixer: what QK^T and attention-over-values
        contract over (heads x head_dim each for standard attention)."""
        if kind.mixer == "mla":
            return self.heads * self.mla_qk_head_dim, self.heads * self.cfg.v_head_dim
        if kind.mixer == "attention":
            return self.q_size, self.q_size
        return 0, 0

    def cp_kv_width(self, kind: LayerKind) -> int:
        """The key and value width, over all heads, a context-parallel ring passes on per token: K and V of the
        query groups (2 kv_size); MLA's per-head keys and values, H (qk + rope) + H v (Transformer Engine's
        P2P context parallelism sends K and V apart when their head dims differ: context_parallel.py
        AttnFuncWithCPAndKVP2P, enable_mla)."""
        if kind.mixer == "mla":
            return sum(self.attention_widths(kind))
        return 2 * self.kv_size if kind.mixer == "attention" else 0

    def attention_head_dim(self, kind: LayerKind) -> int:
        """The head dimension the attention kernel runs at (its efficiency depends on it): for MLA, the
        query/key head dimension; for a Mamba mixer, the scan's."""
        if kind.mixer == "mamba":
            return self.cfg.mamba_head_dim
        return self.mla_qk_head_dim if kind.mixer == "mla" else self.head_dim

    # --- parameters on one device ------------------------------------------------------------
    def attention_params(self, tp: int) -> int:
        h, bias = self.h, self.cfg.add_bias_linear
        qkv = h * (self.q_size + 2 * self.kv_size) // tp + (self.q_size + 2 * self.kv_size) // tp * bias
        proj = self.q_size * h // tp + h * bias  # row-parallel bias is not split
        # --qk-layernorm: q_layernorm and k_layernorm over one head (attention.py SelfAttention, hidden_size_per_
        # attention_head), on every rank
        qk_norms = 2 * self.head_dim * (2 if self.cfg.normalization == "LayerNorm" else 1) if self.cfg.qk_layernorm else 0
        return qkv + proj + qk_norms + self.norm_params  # the input norm is fused into the QKV linear

    def mla_params(self, tp: int) -> int:
        """MLASelfAttention's parameters on one TP rank, and the input norm. The query and KV up projections
        and the output projection are split over TP like QKV and the projection; the down projections are
        duplicated (TE) or split (local: `mla_down_split`); q_layernorm and kv_layernorm exist with
        --qk-layernorm (the TE spec fuses them into the up projections, TELayerNormColumnParallelLinear), on
        every rank. Only linear_proj has a bias (add_bias_linear); the others are built with bias=False."""
        m, h = self.cfg, self.h
        split = tp if self.mla_down_split else 1
        norm = 2 if m.normalization == "LayerNorm" else 1
        q_up = self.heads * self.mla_qk_head_dim // tp
        if m.q_lora_rank is None:
            q = h * q_up  # linear_q_proj, column-parallel
        else:
            q = h * m.q_lora_rank // split + m.q_lora_rank * q_up + (norm * m.q_lora_rank if m.qk_layernorm else 0)
        kv = (h * self.mla_kv_down_width // split
              + m.kv_lora_rank * self.heads * (m.qk_head_dim + m.v_head_dim) // tp
              + (norm * m.kv_lora_rank if m.qk_layernorm else 0))
        proj = self.heads * m.v_head_dim // tp * h + h * m.add_bias_linear
        return q + kv + proj + self.norm_params

    def mixer_params(self, kind: LayerKind, tp: int) -> int:
        """The mixer block's parameters on one device, its pre-norm included."""
        if kind.mixer == "attention":
            return self.attention_params(tp)
        if kind.mixer == "mla":
            return self.mla_params(tp)
        if kind.mixer == "mamba":
            return self.mamba_params(tp)
        return 0

    def tp_replicated_params(self, kind: LayerKind, tp: int) -> int:
        """Linear weights of one layer duplicated on every TP rank: MLA's down projections under Transformer
        Engine, a latent MoE's fc1_latent_proj and fc2_latent_proj (`latent_proj_params`). With sequence parallel
        each rank sees other tokens, so Megatron all-reduces their gradients over TP once a step
        (finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads, the parameters' `sequence_parallel`
        attribute, set by TELinear for parallel_mode='duplicated': megatron-core 0.16.1
        extensions/transformer_engine.py:648-651). Norm weights are reduced the same way and left out: a few h per
        layer."""
        if tp == 1:
            return 0
        latent = self.latent_proj_params if kind.mlp == "moe" else 0
        if kind.mixer != "mla" or self.mla_down_split:
            return latent
        q = self.h * self.cfg.q_lora_rank if self.cfg.q_lora_rank is not None else 0
        return latent + q + self.h * self.mla_kv_down_width

    def dense_mlp_params(self, tp: int, ffn: int | None = None, width: int | None = None) -> int:
        """An MLP's FC1 and FC2 (and biases) on one of `tp` ranks: `width` (default hidden_size) -> ffn -> `width`."""
        h, f, bias = width or self.h, ffn or self.cfg.ffn_hidden_size, self.cfg.add_bias_linear
        fc1 = h * f * self.fc1_factor // tp + f * self.fc1_factor // tp * bias
        fc2 = f * h // tp + h * bias
        return fc1 + fc2

    @property
    def latent_proj_params(self) -> int:
        """A latent MoE layer's fc1_latent_proj (h -> latent) and fc2_latent_proj (latent -> h), TELinear with
        parallel_mode='duplicated': the whole weight (and bias with add_bias_linear) on every TP rank (megatron-core
        0.16.1 moe/moe_layer.py:169-193); 0 without a latent size."""
        latent = self.cfg.moe_latent_size
        if not latent:
            return 0
        return 2 * self.h * latent + (latent + self.h) * self.cfg.add_bias_linear

    def moe_params(self, *, ep: int, etp: int) -> tuple[int, int]:
        """(replicated, expert) parameters of one MoE MLP on one device.

        Expert weights are split over EP (whole experts) and expert-TP, each at `moe_token_width` (the latent size
        with --moe-latent-size); the router, the pre-MLP norm and a latent MoE's two projections are replicated; a
        shared expert is split like a dense MLP over TP.
        """
        experts = self.cfg.num_experts // ep * self.dense_mlp_params(etp, self.moe_ffn, self.moe_token_width)
        replicated = self.h * self.cfg.num_experts + self.norm_params + self.latent_proj_params
        return replicated, experts

    def mlp_params(self, kind: LayerKind, *, tp: int, ep: int, etp: int) -> tuple[int, int]:
        """(dense, expert) parameters of the MLP block on one device, its pre-norm included."""
        if kind.mlp == "dense":
            return self.dense_mlp_params(tp) + self.norm_params, 0
        if kind.mlp == "moe":
            replicated, experts = self.moe_params(ep=ep, etp=etp)
            shared = self.cfg.moe_shared_expert_intermediate_size
            return replicated + (self.dense_mlp_params(tp, shared) if shared else 0), experts
        return 0, 0

    def mtp_block_params(self, tp: int) -> int:
        """What a multi-token-prediction depth adds to its layer (megatron-core MultiTokenPredictionLayer):
        enorm and hnorm, eh_proj (2h -> h, column-parallel, no bias) and final_layernorm."""
        return 3 * self.norm_params + 2 * self.h * self.h // tp

    def layer_params(self, *, tp: int, ep: int = 1, etp: int = 1, kind: LayerKind | None = None) -> tuple[int, int]:
        """(dense, expert) parameters of one layer of `kind` (default: `default_kind`) on one device.

        Dense parameters are averaged over the data-parallel group; expert parameters over the
        expert-data-parallel group, which is why the two are kept apart.
        """
        kind = kind or self.default_kind
        traced = self.traced_layer(tp=tp, ep=ep, etp=etp, kind=kind)
        if traced:
            return traced[1].dense_params, traced[1].expert_params
        dense, expert = self.mlp_params(kind, tp=tp, ep=ep, etp=etp)
        dense += self.mixer_params(kind, tp)
        if kind.mtp:
            dense += self.mtp_block_params(tp)
        return dense, expert

    def embedding_params(self, tp: int) -> int:
        """Word (and learned position) embeddings on the first stage."""
        words = self.padded_vocab(tp) * self.h // tp
        positions = self.cfg.seq_length * self.h if self.cfg.position_embedding_type == "learned_absolute" else 0
        return words + positions

    def output_params(self, *, tp: int, pp: int) -> int:
        """Final norm and output layer on the last stage.

        With tied embeddings and more than one stage Megatron keeps a copy of the word embedding
        on the last stage (kept in sync by an all-reduce of its gradient); on a single stage the
        output layer is the embedding itself and adds nothing.
        """
        head = self.padded_vocab(tp) * self.h // tp
        if not self.cfg.untie_embeddings_and_output_weights and pp == 1:
            head = 0
        return self.norm_params + head

    def mtp_embedding_params(self, *, tp: int, pp: int) -> int:
        """The embedding multi-token prediction adds to the last stage: its depths embed the shifted tokens, so
        with more than one stage the last holds the embedding too (gpt_model.py builds it where
        `mtp_process`; language_module.py keeps it in sync with the first stage's). With tied embeddings that
        copy is the output layer's weight already (`output_params`)."""
        if not self.mtp_depths or pp == 1 or not self.cfg.untie_embeddings_and_output_weights:
            return 0
        return self.embedding_params(tp)

    def has_shared_embedding(self, pp: int) -> bool:
        """Whether the first and last stages hold copies of the word embedding whose gradients Megatron
        all-reduces (finalize_model_grads.py _allreduce_word_embedding_grads): tied embeddings, or the
        embedding multi-token prediction needs on the last stage."""
        return pp > 1 and (not self.cfg.untie_embeddings_and_output_weights or self.mtp_depths > 0)

    # --- forward GEMMs of one layer on one device -------------------------------------------
    def layer_gemms(self, *, tokens: int, tp: int, sp: bool = True, ep: int = 1, etp: int = 1,
                    kind: LayerKind | None = None) -> list[Gemm]:
        """GEMMs of one layer's forward pass for `tokens` tokens on one device (after CP).

        Experts compute `routed_rows` rows; under TP the router sees this rank's sequence shard. `sp`:
        whether tensors outside the TP-split linears are sequence-sharded (what MLA's duplicated down
        projections then run on). `kind` defaults to `default_kind`.
        """
        kind = kind or self.default_kind
        traced = self.traced_layer(tp=tp, etp=etp, kind=kind)
        if traced:  # the traced GEMMs, their rows (tokens, or routed tokens) scaled to `tokens`
            graph, layer = traced
            return [Gemm(gemm_role(g.name), g.m * tokens / graph.tokens, g.n, g.k) for g in layer.gemms]
        gemms = self.mtp_gemms(tokens=tokens, tp=tp) if kind.mtp else []
        return (gemms + self.mixer_gemms(kind, tokens=tokens, tp=tp, sp=sp)
                + self.mlp_gemms(kind, tokens=tokens, tp=tp, ep=ep, etp=etp))

    def mixer_gemms(self, kind: LayerKind, *, tokens: int, tp: int, sp: bool) -> list[Gemm]:
        h = self.h
        if kind.mixer == "attention":
            return [Gemm("qkv", tokens, (self.q_size + 2 * self.kv_size) // tp, h),
                    Gemm("proj", tokens, h, self.q_size // tp)]
        if kind.mixer == "mamba":
            return [Gemm("in_proj", tokens, self.mamba_in_proj_width // tp, h),
                    Gemm("out_proj", tokens, h, self.mamba_inner // tp)]
        if kind.mixer != "mla":
            return []
        m = self.cfg
        # The duplicated down projections run on this rank's tokens (its sequence shard with SP), the split
        # ones (local spec) on the gathered sequence, a 1/tp share of their outputs.
        local = self.mla_down_split
        down_rows = tokens if local or not sp else tokens // tp
        split = tp if local else 1
        q_up = self.heads * self.mla_qk_head_dim // tp
        gemms = ([Gemm("q_proj", tokens, q_up, h)] if m.q_lora_rank is None else
                 [Gemm("q_down", down_rows, m.q_lora_rank // split, h), Gemm("q_up", tokens, q_up, m.q_lora_rank)])
        return gemms + [
            Gemm("kv_down", down_rows, self.mla_kv_down_width // split, h),
            Gemm("kv_up", tokens, self.heads * (m.qk_head_dim + m.v_head_dim) // tp, m.kv_lora_rank),
            Gemm("proj", tokens, h, self.heads * m.v_head_dim // tp),
        ]

    def mlp_gemms(self, kind: LayerKind, *, tokens: int, tp: int, ep: int, etp: int) -> list[Gemm]:
        h = self.h
        if kind.mlp == "dense":
            f = self.cfg.ffn_hidden_size
            return [Gemm("fc1", tokens, f * self.fc1_factor // tp, h), Gemm("fc2", tokens, h, f // tp)]
        if kind.mlp != "moe":
            return []
        f, width = self.moe_ffn, self.moe_token_width
        # A grouped GEMM over this device's experts, each with its share of the routed rows: padded to capacity,
        # exactly that share (`routed_rows`); else the busiest expert-parallel rank sets the pace (`expert_load`).
        local = max(1, self.cfg.num_experts // ep)
        routed = self.routed_rows(tokens=tokens, tp=tp, etp=etp)
        if self.cfg.moe_pad_expert_input_to_capacity:
            rows = routed // local
        else:
            rows = math.ceil(routed * self.expert_load / local)
        gemms = [Gemm("router", tokens // tp, self.cfg.num_experts, h)]
        latent = self.cfg.moe_latent_size
        if latent:  # the duplicated projections, on this rank's tokens (its sequence shard: MoE with TP runs SP)
            gemms.append(Gemm("latent_fc1", tokens // tp, latent, h))
        gemms += [
            Gemm("expert_fc1", rows, f * self.fc1_factor // etp, width, local),
            Gemm("expert_fc2", rows, width, f // etp, local),
        ]
        if latent:
            gemms.append(Gemm("latent_fc2", tokens // tp, h, latent))
        shared = self.cfg.moe_shared_expert_intermediate_size
        if shared:
            gemms += [
                Gemm("shared_fc1", tokens, shared * self.fc1_factor // tp, h),
                Gemm("shared_fc2", tokens, h, shared // tp),
            ]
        return gemms

    def mtp_gemms(self, *, tokens: int, tp: int) -> list[Gemm]:
        """A multi-token-prediction depth's own GEMM: eh_proj on the concatenated [embedding, hidden], 2h -> h
        (column-parallel: the gathered sequence, a 1/tp share of the outputs)."""
        return [Gemm("eh_proj", tokens, self.h // tp, 2 * self.h)]

    def routed_rows(self, *, tokens: float, tp: int, etp: int) -> float:
        """Rows one device's experts compute in expectation (balanced routing). Megatron runs MoE
        with TP under sequence parallelism: each rank routes its tokens / tp, and the dispatcher's
        all-gather over the expert-TP x EP group brings etp x ep ranks' shares to experts of which
        this device holds 1/ep, so ep cancels: tokens x topk x etp / tp (checked against a traced
        megatron-core layer, tests/test_trace.py). Padded to capacity, every expert takes megatron-core's capacity
        of each rank's tokens, ceil(tokens / tp x topk / experts x factor) (moe_utils.get_capacity;
        token_dispatcher.py:485-505 at megatron-core 0.16.1), from each of the etp x ep ranks: the padding rows are
        permuted, sent and computed as any other."""
        topk, experts = self.cfg.moe_router_topk, self.cfg.num_experts
        if self.cfg.moe_pad_expert_input_to_capacity:
            return experts * math.ceil(tokens / tp * topk / experts * self.cfg.moe_expert_capacity_factor) * etp
        return tokens * topk * etp / tp

    @property
    def expert_load(self) -> float:
        """The busiest expert-parallel rank's routed rows over the balanced share, what its experts and the token
        dispatch wait for: model.moe_load_imbalance (1: balanced routing), at most the capacity factor where tokens
        are dropped, and exactly it where the experts' input is padded to capacity."""
        factor, imbalance = self.cfg.moe_expert_capacity_factor, self.cfg.moe_load_imbalance
        if factor is None:
            return imbalance
        return factor if self.cfg.moe_pad_expert_input_to_capacity else min(imbalance, factor)

    def attention_flops(self, *, micro_batch: int, tp: int, cp: int, kind: LayerKind | None = None) -> float:
        """Forward FLOPs of QK^T and attention-over-values on one device.

        Each of the s/cp local queries attends over the whole sequence (CP exchanges K/V), and a
        causal kernel skips the masked half: 2 FLOP x b x (s/cp) x keys x (query/key width + value width) / tp
        (`attention_widths`; 4 b (s/cp) s/2 q_size / tp for standard attention). Megatron's MFU formula counts
        the full square instead (cost/flops.py).
        """
        kind = kind or self.default_kind
        traced = self.traced_layer(tp=tp, kind=kind)
        if traced:  # what the traced kernels compute (the local spec's unfused attention: the full square)
            graph, layer = traced
            return layer.attention_flops * micro_batch / (graph.micro_batch_size * cp)
        if kind.mixer == "mamba":
            return self.mamba_scan_flops(tokens=micro_batch * self.cfg.seq_length // cp, tp=tp)
        qk, v = self.attention_widths(kind)
        s = self.cfg.seq_length
        causal = 0.5 if self.cfg.family == "gpt" else 1.0
        return 2.0 * micro_batch * (s // cp) * self.mean_keys_per_query(s, causal) * (qk + v) / tp

    def mamba_scan_flops(self, *, tokens: float, tp: int) -> float:
        """Forward FLOPs of the chunked SSD scan (mamba_split_conv1d_scan_combined) on one TP rank: Megatron-LM's
        own count, 7 per token, inner channel and state element (training.py:885-903 at d98e8a6, which calls
        it a small share of the layer), at this mixer's d_inner."""
        return 7.0 * tokens * self.mamba_inner * self.cfg.mamba_state_dim / tp

    def mean_keys_per_query(self, s: int, causal: float) -> float:
        """Keys one query attends to, averaged over the layers: s x causal with full attention; a
        sliding window of w past tokens (model.window_size) attends to about w where w < s / 2; with
        model.window_attn_skip_freq = N every N-th layer keeps full attention (the mean over the
        pattern prices every stage alike: exact for the model, close for a stage)."""
        w = self.cfg.window_size
        if not w:
            return s * causal
        windowed = min(w * (1 - w / (2 * s)), s * causal)  # the first w queries see fewer than w keys
        skip = self.cfg.window_attn_skip_freq
        full_share = 1 / skip if skip else 0.0
        return full_share * s * causal + (1 - full_share) * windowed


# megatron-core's module names (relative to the layer) -> the GEMM roles the cost model prices by
MEGATRON_GEMM_ROLES = {"self_attention.linear_qkv": "qkv", "self_attention.linear_proj": "proj", "mlp.linear_fc1": "fc1",
                       "mlp.linear_fc2": "fc2", "mlp.router": "router", "mlp.shared_experts.linear_fc1": "shared_fc1",
                       "mlp.shared_experts.linear_fc2": "shared_fc2", "mlp.experts.linear_fc1": "expert_fc1",
                       "mlp.experts.linear_fc2": "expert_fc2", "self_attention.linear_q_proj": "q_proj",
                       "self_attention.linear_q_down_proj": "q_down", "self_attention.linear_q_up_proj": "q_up",
                       "self_attention.linear_kv_down_proj": "kv_down", "self_attention.linear_kv_up_proj": "kv_up",
                       "eh_proj": "eh_proj", "mlp.fc1_latent_proj": "latent_fc1", "mlp.fc2_latent_proj": "latent_fc2"}
MTP_LAYER_PREFIX = "transformer_layer."  # a multi-token-prediction depth's layer (MultiTokenPredictionLayer)


def gpt_model(cfg: ModelConfig) -> bool:
    """Whether Megatron builds the model as a GPTModel (not a hybrid Mamba stack, not BERT)."""
    return cfg.family == "gpt" and cfg.hybrid_layer_pattern is None


def gemm_role(traced_name: str) -> str:
    """The role of a traced GEMM (qkv, proj, fc1, ...); other models' names are kept as they are."""
    return MEGATRON_GEMM_ROLES.get(traced_name.removeprefix(MTP_LAYER_PREFIX), traced_name)


@lru_cache(maxsize=256)
def _traced_graph(model: ModelSpec, tp: int, ep: int, etp: int) -> LayerGraph | None:
    return model.tracer(tp, ep, etp)
