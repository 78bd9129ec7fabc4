"""megatron-core on a CPU-only machine: every patch it needs (`prepare_cpu_megatron`, patches 0-8,
and `meta_cuda_is_identity`, patch 9, and patches 10-11, one comment each) -- for real CPU tensors here and for the
meta-device tracing of nest_megatron/trace/meta.py -- and the activation memory of ONE real
megatron-core TransformerLayer measured on CPU.

Why this exists
---------------
Activation-memory models (e.g. Korthikanti et al., arXiv 2205.05198, which gives
``s*b*h*(34 + 5*a*s/h)`` bytes per GPT layer with dropout, bf16) are easy to get
subtly wrong once the layer deviates from the paper's GPT (SwiGLU, GQA, no
dropout, RMSNorm, RoPE, selective recompute ...).  Instead of re-deriving the
formula by hand we run the *real* ``megatron.core`` layer built from the local
spec (``get_gpt_layer_local_spec``) and record every tensor autograd keeps for
the backward pass, via ``torch.autograd.graph.saved_tensors_hooks``.

What is counted
---------------
* Every tensor packed by autograd during ONE forward of the layer (input
  ``[s, b, h]`` bf16, ``requires_grad=True`` like the output of a previous layer).
* Parameters (weights saved by the linears / norms for their grads) are NOT
  activations; they are reported separately and excluded from the totals.
* The layer *input* ``hidden_states`` is an activation of this layer when it is
  saved (it is the input of ``input_layernorm``); Korthikanti count it (the
  "LayerNorm input, 2sbh").  It is included in the totals and flagged.

De-duplication: storage bytes, not tensor bytes
-----------------------------------------------
Autograd often saves the same memory several times (one op's output is the next
op's saved input) or saves *views* (``value`` is a slice of the fused QKV output,
``x_glu`` is one half of the fc1 output, the causal mask is an ``expand``-ed
``[s, s]`` tensor).  We therefore group saved tensors by their storage
(``t.untyped_storage().data_ptr()``) and count each storage once, with

* ``bytes`` (the headline number) = ``untyped_storage().nbytes()``: a saved view
  keeps its *whole* base storage alive, so this is the memory really held until
  backward.  Summing ``t.nbytes`` instead would undercount slices (value-of-QKV,
  half of fc1) and overcount broadcast views (stride-0 masks).
* ``referenced_bytes`` = the bytes the saved views actually address inside
  their storage (computed exactly, element by element).  The difference
  ``bytes - referenced_bytes`` is memory pinned only because a view of it was
  saved ("slack"); an implementation that copied the slice would not keep it.

Attribution
-----------
Forward pre/post hooks on every submodule of the layer maintain a stack; a
saved tensor is attributed to the innermost megatron submodule executing when
autograd packed it.  Code running directly in ``TransformerLayer.forward``
(the bias-dropout-add functions, which are not modules) is labelled
``self_attn_bda`` or ``mlp_bda`` depending on which child last finished.  A
storage saved by several ops is attributed to the first saver.  The op that saved
each tensor is recovered afterwards by walking the autograd graph and reading
each node's saved tensors (the grad_fn class name, e.g. ``SoftmaxBackward0``).

CPU-only caveats (see ``measure_layer_saved_bytes`` docstring for the list).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

__all__ = ["prepare_cpu_megatron", "meta_cuda_is_identity", "measure_layer_saved_bytes"]

_PREPARED = False


# ---------------------------------------------------------------------------
# CPU patches
# ---------------------------------------------------------------------------
def bind_missing_te_gemm() -> None:
    """megatron-core 0.16 binds moe_utils.te_general_gemm only when Transformer Engine imports, yet
    its MoE router reads the name whatever is installed (RouterGatingLinearFunction: `if
    te_general_gemm is not None`): without TE every MoE forward raises NameError, on a CPU and on a
    GPU alike. None selects the router's torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def import_megatron_core_uncompiled() -> None:
    """Patch 0: import megatron-core with torch.compile as the identity, unless this process has already.

    megatron-core decorates its fused kernels with torch.compile when it is imported (megatron.core.jit.jit_fuser),
    which loads TorchDynamo and TorchInductor: ~1.5 s of CPU in every process, ~10 s on a busy 2-core machine.
    None of those kernels runs on a CPU here (every fusion is off: trace/transformer_config.py and
    scripts/pretrain_gpt.py), and jit_fuser keeps the identity for later imports too. CPU processes only: on a GPU
    the fused kernels are what runs.
    """
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile

    def _no_compile(model=None, **_options):
        return model if model is not None else (lambda fn: fn)

    torch.compile = _no_compile
    try:
        import megatron.core  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.transformer.moe.moe_layer  # noqa: F401
    finally:
        torch.compile = compile_


def prepare_cpu_megatron() -> None:
    """Make megatron-core 0.16.x usable on a CPU-only torch build.  Idempotent.

    Each patch is applied at most once; calling this again is a no-op.
    """
    global _PREPARED
    if _PREPARED:
        return

    import torch.distributed as dist

    # Megatron emits import-time warnings about missing Apex/TE; they are
    # expected here and only add noise.
    warnings.filterwarnings("ignore", message=".*Apex.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

    import_megatron_core_uncompiled()  # patch 0

    # Patch 1: torch.cuda.current_device() is used as the `device=` argument
    # when megatron allocates tensors (GlobalMemoryBuffer.get_tensor, which
    # DotProductAttention uses for the baddbmm output; RotaryEmbedding's
    # inv_freq at the first forward; parameter allocation when
    # use_cpu_initialization is off).  Returning torch's default device puts them
    # on CPU, or on the meta device inside a `with torch.device("meta")` block.
    # Applied even if a GPU is visible: this module measures on CPU and meta
    # tensors, and a CUDA buffer would not mix with them (so don't import it in
    # a GPU job).
    torch.cuda.current_device = torch.get_default_device  # type: ignore[assignment]

    from megatron.core import parallel_state
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as tr_utils

    # Patch 2: the unfused softmax path builds the causal mask with
    # `get_default_causal_mask`, which hard-codes device="cuda".  Replace it
    # (in both the defining module and fused_softmax, which imported the name)
    # with an identical version on torch's default device (CPU, or meta while
    # tracing; uncached, like upstream: a fresh [s, s] bool tensor per call,
    # which masked_fill_ then saves).
    def _cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    tr_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask

    # Patch 3: selective recompute runs through tensor_parallel.CheckpointFunction,
    # which snapshots / restores the CUDA RNG state via _get_cuda_rng_state /
    # _set_cuda_rng_state (torch.cuda.get_rng_state fails without CUDA).  The
    # CPU RNG, which drives dropout here, is already snapshotted separately
    # by torch.get_rng_state(), so a dummy CUDA state is enough.
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *a, **k: None

    # Patch 4: the MoE router without Transformer Engine (bind_missing_te_gemm; irrelevant for this dense
    # layer, kept for MoE).
    try:
        bind_missing_te_gemm()
    except Exception:  # pragma: no cover - MoE module layout changed
        pass

    # Patch 5: megatron's modules ask parallel_state for TP/PP/CP groups.  A
    # single-process gloo group (HashStore: no network, no port) + TP=PP=1.
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)

    # Patch 6: the default (training) RNG tracker seeds and snapshots CUDA
    # generators.  The "inference" tracker makes `fork()` a nullcontext, so the
    # attention dropout simply uses torch's default CPU generator.
    # Signature (0.16.1): initialize_rng_tracker(use_te_rng_tracker=False,
    #   inference_rng_tracker=False, use_cudagraphable_rng=False, force_reset=False)
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    # Patch 7: on the meta device a router's choice has no data, and the all-gather dispatcher
    # sizes its permutation from it (routing_map.sum().cpu(), masked_select). Route tokens as in
    # expectation instead -- balanced, tokens x topk / experts to each expert, what the cost model
    # assumes -- through megatron's own shape-static permute (its drop-and-pad path at exactly
    # that capacity). Real tensors take megatron's path unchanged.
    try:
        from megatron.core.transformer.moe import token_dispatcher
        from megatron.core.transformer.moe.moe_utils import permute

        allgather = token_dispatcher.MoEAllGatherTokenDispatcher
        data_postprocess = allgather.dispatch_postprocess

        def dispatch_postprocess(self, hidden_states, probs):
            if not hidden_states.is_meta:
                return data_postprocess(self, hidden_states, probs)
            self.hidden_shape_before_permute = hidden_states.shape
            local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
            self.local_map = self.routing_map[:, local].contiguous()
            per_expert = hidden_states.shape[0] * self.router_topk // self.config.num_moe_experts
            tokens_per_expert = torch.full((self.num_local_experts,), per_expert, dtype=torch.long, device="cpu")
            permuted, self.local_probs, self.reversed_local_input_permutation_mapping = permute(
                hidden_states, self.local_map, probs=probs[:, local].contiguous(),
                num_out_tokens=per_expert * self.num_local_experts, drop_and_pad=True)
            self.routing_map = None
            return permuted, tokens_per_expert, self.local_probs

        allgather.dispatch_postprocess = dispatch_postprocess
    except ImportError:  # pragma: no cover - MoE module layout changed
        pass

    # Patch 8: the local spec's torch norms (WrappedTorchNorm, used without Apex) refuse
    # sequence_parallel, because they do not tag their weights for the SP gradient all-reduce --
    # which matters for training numerics, not for shapes, FLOPs or saved bytes. Build them from
    # a copy of the config with SP off; the rest of the layer (the scatter after the embedding,
    # the all-gathers and reduce-scatters of the linears) runs sequence-parallel as on a GPU.
    from megatron.core.transformer import torch_norm

    build_norm = torch_norm.WrappedTorchNorm.__new__

    def wrapped_torch_norm(cls, config, *args, **kwargs):
        if config.sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        return build_norm(cls, config, *args, **kwargs)

    torch_norm.WrappedTorchNorm.__new__ = wrapped_torch_norm

    # Patch 10: MLASelfAttention builds its core attention with the query/key and value head dims
    # (k_channels, v_channels: qk_head_dim + qk_pos_emb_head_dim and v_head_dim), which only Transformer
    # Engine's TEDotProductAttention takes; the local spec's DotProductAttention raises. Its forward already
    # computes with the heads' own widths (baddbmm over q/k, bmm over v); only its output width comes from
    # kv_channels. Take the two arguments and size the output from v_channels, as TE's does.
    from megatron.core.transformer import dot_product_attention

    local_attention_init = dot_product_attention.DotProductAttention.__init__

    def attention_init(self, *args, k_channels=None, v_channels=None, **kwargs):
        local_attention_init(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    dot_product_attention.DotProductAttention.__init__ = attention_init

    # Patch 11: without Transformer Engine, megatron-core 0.16's extensions module still defines TELinear (on a
    # MagicMock stand-in for transformer_engine), so multi_latent_attention.py's `import ... TELinear` succeeds, sets
    # HAVE_TE = True and its isinstance(self.linear_proj, TELinear) raises TypeError. Give it the extensions
    # module's own answer (False without TE), which skips that fp8-only branch.
    from megatron.core.extensions import transformer_engine as te_extensions
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = te_extensions.HAVE_TE

    # Patch 12: CheckpointWithoutOutput (the "layernorm", "moe_act" and "mla_up_proj" recompute modules) sets
    # `self.fp8 = fp8 is not None` (tensor_parallel/random.py:636), True for its default fp8=False, and then asks
    # Transformer Engine's FP8GlobalStateManager whether fp8 is on -- a NameError without TE. With TE the answer
    # outside an fp8 autocast is "no", the fp8=False path: take that path here.
    init = mp_random.CheckpointWithoutOutput.__init__

    def _init_without_te(self, fp8=False):
        init(self, fp8)
        self.fp8 = bool(fp8) and te_extensions.HAVE_TE

    mp_random.CheckpointWithoutOutput.__init__ = _init_without_te

    _PREPARED = True


@contextlib.contextmanager
def meta_cuda_is_identity():
    """Patch 9 (while building a model on meta): with tied embeddings and PP > 1,
    LanguageModule.setup_embeddings_and_output_layer moves the word-embedding
    copy to CUDA (`weight.data.cuda()`) before all-reducing it over the
    embedding group.  A meta tensor has no data to move: let `.cuda()` return
    it unchanged."""
    original = torch.Tensor.cuda

    def cuda(self, *args, **kwargs):
        return self if self.is_meta else original(self, *args, **kwargs)

    torch.Tensor.cuda = cuda
    try:
        yield
    finally:
        torch.Tensor.cuda = original


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------
class _Saved:
    """One tensor packed by autograd (the pack hook returns this wrapper)."""

    __slots__ = ("tensor", "module", "seq", "op")

    def __init__(self, tensor: torch.Tensor, module: str, seq: int):
        self.tensor = tensor
        self.module = module
        self.seq = seq
        self.op = "?"


def _referenced_bytes(tensors: List[torch.Tensor]) -> int:
    """Exact number of storage bytes addressed by a set of views of ONE storage.

    Marks every element each view touches in a boolean map of the storage
    (``as_strided`` reproduces the view's exact addressing, so strided slices and
    stride-0 broadcasts are handled exactly).  Falls back to the storage size when
    the views disagree on element size (never observed here). A storage a recompute
    module freed after the forward (CheckpointWithoutOutput's discarded output) holds none.
    """
    nbytes = tensors[0].untyped_storage().nbytes()
    if nbytes == 0:
        return 0
    item = tensors[0].element_size()
    if any(t.element_size() != item for t in tensors) or nbytes % item:
        return nbytes
    touched = torch.zeros(nbytes // item, dtype=torch.bool)
    for t in tensors:
        touched.as_strided(t.shape, t.stride(), t.storage_offset()).fill_(True)
    return int(touched.sum()) * item


def _label_ops(roots, last_unpacked: List[_Saved]) -> None:
    """Walk the autograd graph; name the grad_fn that owns each saved tensor.

    Reading a node's saved tensors calls our unpack hook, which appends the
    wrapper to `last_unpacked`; we then stamp it with the node's class name.
    """
    seen, stack = set(), [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if hasattr(node, "saved_tensors") and not hasattr(node, "_saved_self"):
            # Custom autograd.Function (BackwardCFunction): ctx.saved_tensors.
            attrs = ["saved_tensors"]
        else:
            attrs = [a for a in dir(node) if a.startswith("_saved_")]
        for a in attrs:
            last_unpacked.clear()
            try:
                getattr(node, a)
            except Exception:
                pass
            for rec in last_unpacked:
                if rec.op == "?":
                    rec.op = f"{name}.{a}"
        last_unpacked.clear()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)


def _build_layer(cfg, normalization: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(normalization=normalization)
    layer = build_module(spec, config=cfg, layer_number=1)
    # Megatron training wraps the model in Float16Module, which casts ALL params
    # (incl. the torch LayerNorm/RMSNorm created in fp32 by WrappedTorchNorm) to
    # bf16; do the same so the norm outputs are bf16 as in real training.
    return layer.to(torch.bfloat16).train()


def measure_layer_saved_bytes(
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    seq_length: int,
    micro_batch_size: int,
    swiglu: bool,
    hidden_dropout: float,
    attention_dropout: float,
    recompute_granularity: Optional[str] = None,
    recompute_modules: Optional[List[str]] = None,
    normalization: str = "RMSNorm",
    use_rope: bool = True,
    attention_softmax_in_fp32: bool = True,
    run_backward: bool = True,
    seed: int = 1234,
) -> Dict[str, Any]:
    """Bytes saved for backward by one forward of one local-spec TransformerLayer.

    Returns a dict with
      total_bytes              activation bytes (storage-deduplicated, params excluded,
                               layer input included if saved)
      total_referenced_bytes   same, counting only the bytes the saved views address
      input_saved, input_saved_by, input_bytes
      param_bytes_saved        parameter bytes autograd also references (not in totals)
      sbh, as2b                s*b*h and a*s*s*b (units for the Korthikanti comparison)
      breakdown                {submodule: {"bytes", "referenced_bytes", "tensors": [...]}}
      config                   the shape arguments

    CPU-only caveats (what differs from a GPU run of the same local spec):
      * F.dropout on CPU is not the fused native_dropout: it saves the scaled
        Bernoulli *noise in the input dtype* (bf16, 2 B/elem, via MulBackward0)
        instead of a 1-byte bool mask (NativeDropoutBackward0 on CUDA).
      * masked_softmax_fusion=False (also the only option on CPU) keeps the
        unfused softmax: with attention_softmax_in_fp32 the scores are upcast and
        the *fp32* softmax output (4 B/elem) is saved, plus its bf16 cast that
        feeds dropout/bmm.  The fused CUDA kernel saves one bf16 copy.
      * torch.nn.RMSNorm (what the local spec uses without Apex) runs torch's
        composite rms_norm on CPU: it upcasts to fp32 and saves the fp32 input and
        the fp32 normalised tensor (8 B per element of [s, b, h]) instead of the
        bf16 input + rstd; the layer input itself is then not saved.  LayerNorm
        (native_layer_norm) saves the bf16 input, as a fused GPU norm would.
    Not CPU-specific but local-spec-specific (same on GPU with this spec): the
    value tensor saved by the attention bmm is a view of the fused QKV output and
    pins that whole storage; GQA k/v are repeat_interleave'd to all heads before
    being saved; the unfused GLU saves an extra copy ``x_linear + glu_linear_offset``.
    """
    prepare_cpu_megatron()
    if recompute_granularity not in (None, "selective"):
        raise ValueError("recompute_granularity must be None or 'selective'")

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from nest_megatron.config.schema import ModelConfig
    from nest_megatron.trace.transformer_config import transformer_config

    torch.manual_seed(seed)
    shape = ModelConfig(
        name="measured-layer",
        num_layers=1,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        seq_length=seq_length,
        vocab_size=1,  # no embedding is built
        swiglu=swiglu,
        normalization=normalization,
        position_embedding_type="rope" if use_rope else "learned_absolute",
        add_bias_linear=False,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        attention_softmax_in_fp32=attention_softmax_in_fp32,
    )
    # The one ModelConfig -> TransformerConfig converter (fusions off: plain torch code paths);
    # real weights here, and selective recompute's default modules = ["core_attn"].
    cfg = transformer_config(shape, perform_initialization=True, recompute_granularity=recompute_granularity,
                             recompute_modules=recompute_modules)
    layer = _build_layer(cfg, normalization)

    s, b, h, a = seq_length, micro_batch_size, hidden_size, num_attention_heads
    rotary_pos_emb = None
    if use_rope:
        rope = RotaryEmbedding(
            kv_channels=cfg.kv_channels, rotary_percent=1.0, use_cpu_initialization=True
        )
        rotary_pos_emb = rope(s)  # [s, 1, 1, kv_channels] fp32, no grad
    # Input like the output of a previous layer: bf16, requires grad.
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)

    # --- module stack for attribution -------------------------------------
    names = {m: n for n, m in layer.named_modules()}
    stack: List[str] = []
    last_child = [""]  # last top-level child of the layer that finished

    def pre(mod, _args):
        stack.append(names[mod])

    def post(mod, _args, _out):
        n = stack.pop()
        if n and "." not in n:
            last_child[0] = n

    handles = []
    for m in layer.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))

    def current_module() -> str:
        n = stack[-1] if stack else "<outside>"
        if n == "":  # code in TransformerLayer.forward itself (BDA functions)
            return {"self_attention": "self_attn_bda", "mlp": "mlp_bda"}.get(
                last_child[0], f"layer(after {last_child[0] or 'start'})"
            )
        return n

    records: List[_Saved] = []
    last_unpacked: List[_Saved] = []

    def pack(t: torch.Tensor) -> _Saved:
        rec = _Saved(t, current_module(), len(records))
        records.append(rec)
        return rec

    def unpack(rec: _Saved) -> torch.Tensor:
        last_unpacked.append(rec)
        return rec.tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out, _bias = layer(x, attention_mask=None, rotary_pos_emb=rotary_pos_emb)
    finally:
        for hd in handles:
            hd.remove()

    _label_ops([out.grad_fn], last_unpacked)

    # --- classify and de-duplicate by storage -----------------------------
    def sptr(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    param_ptrs = {sptr(p) for p in layer.parameters()}
    input_ptr = sptr(x)
    by_storage: Dict[int, List[_Saved]] = defaultdict(list)
    param_bytes: Dict[int, int] = {}
    for rec in records:
        p = sptr(rec.tensor)
        if p in param_ptrs:
            param_bytes[p] = rec.tensor.untyped_storage().nbytes()
        else:
            by_storage[p].append(rec)

    breakdown: Dict[str, Dict[str, Any]] = {}
    total = total_ref = 0
    input_saved_by: List[str] = []
    for p, recs in sorted(by_storage.items(), key=lambda kv: kv[1][0].seq):
        owner = recs[0].module  # first saver owns the storage
        nbytes = recs[0].tensor.untyped_storage().nbytes()
        ref = _referenced_bytes([r.tensor for r in recs])
        total += nbytes
        total_ref += ref
        if p == input_ptr:
            input_saved_by = sorted({f"{r.module}:{r.op}" for r in recs})
        ent = breakdown.setdefault(owner, {"bytes": 0, "referenced_bytes": 0, "tensors": []})
        ent["bytes"] += nbytes
        ent["referenced_bytes"] += ref
        ent["tensors"].append(
            {
                "storage_bytes": nbytes,
                "referenced_bytes": ref,
                "is_layer_input": p == input_ptr,
                "saves": [
                    {
                        "module": r.module,
                        "op": r.op,
                        "shape": tuple(r.tensor.shape),
                        "dtype": str(r.tensor.dtype).replace("torch.", ""),
                        "nbytes": r.tensor.nbytes,
                    }
                    for r in recs
                ],
            }
        )

    if run_backward:  # sanity: the measured graph really trains (and recomputes)
        (out.float().square().mean()).backward()
        assert x.grad is not None and torch.isfinite(x.grad.float()).all()

    return {
        "config": dict(
            hidden_size=h,
            ffn_hidden_size=ffn_hidden_size,
            num_attention_heads=a,
            num_query_groups=num_query_groups,
            seq_length=s,
            micro_batch_size=b,
            swiglu=swiglu,
            hidden_dropout=hidden_dropout,
            attention_dropout=attention_dropout,
            recompute_granularity=recompute_granularity,
            recompute_modules=recompute_modules,
            normalization=normalization,
            use_rope=use_rope,
            attention_softmax_in_fp32=attention_softmax_in_fp32,
        ),
        "total_bytes": total,
        "total_referenced_bytes": total_ref,
        "input_saved": bool(input_saved_by),
        "input_saved_by": input_saved_by,
        "input_bytes": x.nbytes,
        "param_bytes_saved": sum(param_bytes.values()),
        "sbh": s * b * h,
        "as2b": a * s * s * b,
        "num_saved_tensors": len(records),
        "breakdown": breakdown,
    }
