"""A transformer's shape and the numbers derived from it: parameters and GEMMs per layer.

Counts follow megatron-core's GPTModel with the layer specs Megatron-LM uses (ColumnParallelLinear
for QKV and FC1, RowParallelLinear for the projection and FC2, vocab-parallel embedding and output
layer), so that per-rank parameter counts match a model built on the meta device exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from nest_megatron.config.schema import ModelConfig
from nest_megatron.model.layer_graph import LayerGraph, LayerTrace

# Megatron's --attention-backend values (megatron/core/transformer/enums.py AttnBackend), and those that run a
# fused kernel keeping no s x s tensor: auto lets Transformer Engine pick cuDNN's fused attention or flash-attn.
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
FUSED_ATTENTION_BACKENDS = ("auto", "flash", "fused")


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


@dataclass(frozen=True, eq=False)  # hashed by identity: per-layer costs are cached per model
class ModelSpec:
    cfg: ModelConfig
    # A traced model (model.source=megatron|hf|module): tracer(tp, ep, etp) is this rank's layer
    # graph at one sequence, or None where the source cannot trace that width. Its per-layer-kind
    # parameters, GEMMs, attention FLOPs and saved bytes replace the analytic ones (`traced_layer`).
    tracer: Callable[[int, int, int], LayerGraph | None] | None = field(default=None, repr=False)
    numerics: Numerics = field(default_factory=lambda: Numerics())

    def traced_layer(self, *, tp: int, ep: int = 1, etp: int = 1, moe: bool | None = None) -> tuple[LayerGraph, LayerTrace] | None:
        """The traced graph at (tp, ep, etp) and its first layer of this kind, or None (analytic)."""
        if self.tracer is None:
            return None
        graph = _traced_graph(self, tp, ep if self.is_moe else 1, etp if self.is_moe else 1)
        if graph is None:
            return None
        moe = self.is_moe if moe is None else moe
        layer = graph.first_of_kind("moe" if moe else "dense") or graph.first_of_kind("block")
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

    @property
    def is_moe(self) -> bool:
        return bool(self.cfg.num_experts)

    @cached_property
    def layer_is_moe(self) -> tuple[bool, ...]:
        """Per transformer layer, whether its MLP is MoE (Megatron's --moe-layer-freq)."""
        return tuple(self.is_moe and i % self.cfg.moe_layer_freq == 0 for i in range(self.cfg.num_layers))

    @property
    def moe_ffn(self) -> int:
        return self.cfg.moe_ffn_hidden_size or self.cfg.ffn_hidden_size

    @property
    def fc1_factor(self) -> int:
        """FC1 produces gate and up projections with SwiGLU."""
        return 2 if self.cfg.swiglu else 1

    @property
    def norm_params(self) -> int:
        return self.h * (2 if self.cfg.normalization == "LayerNorm" else 1)

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.cfg.make_vocab_size_divisible_by * tp
        return math.ceil(self.cfg.vocab_size / multiple) * multiple

    # --- parameters on one device ------------------------------------------------------------
    def attention_params(self, tp: int) -> int:
        h, bias = self.h, self.cfg.add_bias_linear
        qkv = h * (self.q_size + 2 * self.kv_size) // tp + (self.q_size + 2 * self.kv_size) // tp * bias
        proj = self.q_size * h // tp + h * bias  # row-parallel bias is not split
        return qkv + proj + self.norm_params  # the input norm is fused into the QKV linear

    def dense_mlp_params(self, tp: int, ffn: int | None = None) -> int:
        h, f, bias = self.h, ffn or self.cfg.ffn_hidden_size, self.cfg.add_bias_linear
        fc1 = h * f * self.fc1_factor // tp + f * self.fc1_factor // tp * bias
        fc2 = f * h // tp + h * bias
        return fc1 + fc2

    def moe_params(self, *, ep: int, etp: int) -> tuple[int, int]:
        """(replicated, expert) parameters of one MoE MLP on one device.

        Expert weights are split over EP (whole experts) and expert-TP; the router and the
        pre-MLP norm are replicated; a shared expert is split like a dense MLP over TP.
        """
        experts = self.cfg.num_experts // ep * self.dense_mlp_params(etp, self.moe_ffn)
        replicated = self.h * self.cfg.num_experts + self.norm_params
        return replicated, experts

    def layer_params(self, *, tp: int, ep: int = 1, etp: int = 1, moe: bool | None = None) -> tuple[int, int]:
        """(dense, expert) parameters of one transformer layer on one device; `moe` says whether
        this layer's MLP is MoE (default: the model's).

        Dense parameters are averaged over the data-parallel group; expert parameters over the
        expert-data-parallel group, which is why the two are kept apart.
        """
        traced = self.traced_layer(tp=tp, ep=ep, etp=etp, moe=moe)
        if traced:
            return traced[1].dense_params, traced[1].expert_params
        dense = self.attention_params(tp)
        if not (self.is_moe if moe is None else moe):
            return dense + self.dense_mlp_params(tp) + self.norm_params, 0
        replicated, experts = self.moe_params(ep=ep, etp=etp)
        shared = self.cfg.moe_shared_expert_intermediate_size
        if shared:
            dense += self.dense_mlp_params(tp, shared)
        return dense + replicated, experts

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

    # --- forward GEMMs of one layer on one device -------------------------------------------
    def layer_gemms(self, *, tokens: int, tp: int, ep: int = 1, etp: int = 1, moe: bool | None = None) -> list[Gemm]:
        """GEMMs of one layer's forward pass for `tokens` tokens on one device (after CP).

        Experts compute `routed_rows` rows; under TP the router sees this rank's sequence shard.
        `moe` overrides whether this layer's MLP is MoE.
        """
        traced = self.traced_layer(tp=tp, etp=etp, moe=moe)
        if traced:  # the traced GEMMs, their rows (tokens, or routed tokens) scaled to `tokens`
            graph, layer = traced
            return [Gemm(gemm_role(g.name), g.m * tokens / graph.tokens, g.n, g.k) for g in layer.gemms]
        h = self.h
        gemms = [
            Gemm("qkv", tokens, (self.q_size + 2 * self.kv_size) // tp, h),
            Gemm("proj", tokens, h, self.q_size // tp),
        ]
        if not (self.is_moe if moe is None else moe):
            f = self.cfg.ffn_hidden_size
            return gemms + [
                Gemm("fc1", tokens, f * self.fc1_factor // tp, h),
                Gemm("fc2", tokens, h, f // tp),
            ]
        f = self.moe_ffn
        # A grouped GEMM over this device's experts, each with its share of the routed rows; the
        # busiest expert-parallel rank sets the pace (model.moe_load_imbalance, 1: balanced routing).
        local = max(1, self.cfg.num_experts // ep)
        rows = math.ceil(self.routed_rows(tokens=tokens, tp=tp, etp=etp) * self.cfg.moe_load_imbalance / local)
        gemms += [
            Gemm("router", tokens // tp, self.cfg.num_experts, h),
            Gemm("expert_fc1", rows, f * self.fc1_factor // etp, h, local),
            Gemm("expert_fc2", rows, h, f // etp, local),
        ]
        shared = self.cfg.moe_shared_expert_intermediate_size
        if shared:
            gemms += [
                Gemm("shared_fc1", tokens, shared * self.fc1_factor // tp, h),
                Gemm("shared_fc2", tokens, h, shared // tp),
            ]
        return gemms

    def routed_rows(self, *, tokens: float, tp: int, etp: int) -> float:
        """Rows one device's experts compute in expectation (balanced routing). Megatron runs MoE
        with TP under sequence parallelism: each rank routes its tokens / tp, and the dispatcher's
        all-gather over the expert-TP x EP group brings etp x ep ranks' shares to experts of which
        this device holds 1/ep, so ep cancels: tokens x topk x etp / tp (checked against a traced
        megatron-core layer, tests/test_trace.py)."""
        return tokens * self.cfg.moe_router_topk * etp / tp

    def attention_flops(self, *, micro_batch: int, tp: int, cp: int) -> float:
        """Forward FLOPs of QK^T and attention-over-values on one device.

        Each of the s/cp local queries attends over the whole sequence (CP exchanges K/V), and a
        causal kernel skips the masked half: 2 GEMMs x 2 FLOP x b x (s/cp) x s x q_size / tp x 1/2.
        Megatron's MFU formula counts the full square instead (cost/flops.py).
        """
        traced = self.traced_layer(tp=tp)
        if traced:  # what the traced kernels compute (the local spec's unfused attention: the full square)
            graph, layer = traced
            return layer.attention_flops * micro_batch / (graph.micro_batch_size * cp)
        s = self.cfg.seq_length
        causal = 0.5 if self.cfg.family == "gpt" else 1.0
        return 4.0 * micro_batch * (s // cp) * self.mean_keys_per_query(s, causal) * self.q_size / tp

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
                       "mlp.experts.linear_fc2": "expert_fc2"}


def gemm_role(traced_name: str) -> str:
    """The role of a traced GEMM (qkv, proj, fc1, ...); other models' names are kept as they are."""
    return MEGATRON_GEMM_ROLES.get(traced_name, traced_name)


@lru_cache(maxsize=256)
def _traced_graph(model: ModelSpec, tp: int, ep: int, etp: int) -> LayerGraph | None:
    return model.tracer(tp, ep, etp)
