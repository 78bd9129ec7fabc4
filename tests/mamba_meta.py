"""megatron-core 0.16.1's own Mamba-2 layer (megatron/core/ssm/mamba_layer.py MambaLayer with
mamba_mixer.py MambaMixer), built for one TP rank on the meta device, so that tests can compare the
cost model's Mamba parameter count with the module megatron-core really builds.

Only the build runs here, not a forward pass: MambaMixer's training forward is one fused Triton
kernel (mamba_ssm's mamba_split_conv1d_scan_combined: causal conv1d + SSD chunked scan + gating,
mamba_mixer.py:659-676, the path use_mamba_mem_eff_path selects by default) and megatron-core has no
torch fallback for it. Putting a torch re-implementation of the SSD in its place would count the
FLOPs of code written here, not of megatron-core, so there is no forward-FLOP counter in this module;
the cost model prices the scan by Megatron-LM's own count (mamba_layer_flops: 7 x tokens x d_in x state,
megatron/training/training.py:273-293 at core_v0.16.1, :885-904 at d98e8a64).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
import warnings
from unittest import mock

import torch
from torch import nn


class GatedRMSNormStandIn(nn.Module):
    """Stand-in for mamba_ssm.ops.triton.layernorm_gated.RMSNorm (MambaMixer's gated norm,
    ExtendedRMSNorm), a CUDA/Triton-only kernel package that cannot be installed here. Only its
    parameter shapes matter: one weight of `hidden_size` (MambaMixer passes d_inner_local_tp,
    mamba_mixer.py:355-362) and no bias, as in state-spaces/mamba e9594ce
    mamba_ssm/ops/triton/layernorm_gated.py:415-428, whose signature this is."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):  # never called: the builder runs no forward pass
        raise NotImplementedError("GatedRMSNormStandIn has parameter shapes only (mamba_ssm is CUDA-only)")


_TRITON_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def _inference_only(name):
    def kernel(*_args, **_kwargs):
        raise NotImplementedError(f"{name}: a Triton kernel of dynamic inference, absent here (no triton)")
    return kernel


def _import_mamba_mixer():
    """megatron.core.ssm.mamba_mixer, importable without Triton: it imports three Triton kernels of
    dynamic inference at module level (mamba_mixer.py:22-26, tensor_ops.py:6 `import triton`), which
    only MambaMixer._dynamic_inference and _ssm_prefill's inference branches call. Without triton
    they are bound to functions that raise; the stand-in module leaves sys.modules again."""
    if "megatron.core.ssm.mamba_mixer" in sys.modules or importlib.util.find_spec("triton") is not None:
        from megatron.core.ssm import mamba_mixer
        return mamba_mixer
    stub = types.ModuleType(_TRITON_TENSOR_OPS)
    for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        setattr(stub, name, _inference_only(name))
    sys.modules[_TRITON_TENSOR_OPS] = stub
    try:
        from megatron.core.ssm import mamba_mixer
    finally:
        del sys.modules[_TRITON_TENSOR_OPS]
    return mamba_mixer


@contextlib.contextmanager
def _mamba_ssm_stand_in():
    """MambaMixer.__init__ refuses to build without mamba_ssm (HAVE_MAMBA_SSM, mamba_mixer.py:173-176)
    and, without it, its ExtendedRMSNorm subclasses a MagicMock (mamba_mixer.py:67-71, 83). The
    constructor itself calls no mamba_ssm code; the stand-in norm gives the gated norm its shape."""
    mamba_mixer = _import_mamba_mixer()

    with (mock.patch.object(mamba_mixer, "HAVE_MAMBA_SSM", True),
          mock.patch.object(mamba_mixer, "RMSNormGated", GatedRMSNormStandIn),
          mock.patch.object(mamba_mixer, "ExtendedRMSNorm", GatedRMSNormStandIn)):
        yield


def mamba_layer_spec():
    """The Mamba layer of megatron-core's mamba_stack_spec (models/mamba/mamba_layer_specs.py:39-50)
    without Transformer Engine, which does not import here: the pre-norm as its own module (torch
    RMSNorm of hidden, MambaLayer.norm, mamba_layer.py:85) with ColumnParallelLinear in_proj and
    RowParallelLinear out_proj. The parameter count is that of the TE spec, whose norm is IdentityOp
    and whose in_proj is TELayerNormColumnParallelLinear: that module holds the same RMSNorm weight
    (layer_norm_weight of in_features = hidden; no bias with RMSNorm: TE v2.12
    transformer_engine/pytorch/module/layernorm_linear.py:1255-1265) beside the same [out/tp, hidden] weight, so
    fusing the norm into in_proj moves its h parameters, it adds none and removes none; bias=False
    in both (MambaMixer asserts `not bias`, mamba_mixer.py:264)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules

    mamba_mixer = _import_mamba_mixer()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=mamba_mixer.MambaMixer, submodules=mamba_mixer.MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add,
        ),
    )


def build_meta_mamba_layer(*, hidden, state_dim, head_dim, num_groups, num_heads=None, tp=1, fp8=None):
    """Rank 0's MambaLayer of a TP-`tp` (x CP) job on the meta device, its parameters as MambaMixer creates
    them (bf16; A_log and D fp32, mamba_mixer.py:335-350, until Float16Module casts every parameter to
    bf16, transformer/module.py:440). `fp8` is TransformerConfig's (e.g. "hybrid"): MambaMixer checks its
    in_proj width for it (mamba_mixer.py:241-245). Call inside `_as_tp_cp_rank`."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    # num_attention_heads: unused by a Mamba layer; TransformerConfig wants a multiple of TP.
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=tp, normalization="RMSNorm",
        mamba_state_dim=state_dim, mamba_head_dim=head_dim, mamba_num_groups=num_groups,
        mamba_num_heads=num_heads, tensor_model_parallel_size=tp, params_dtype=torch.bfloat16,
        bf16=True, fp8=fp8, use_cpu_initialization=True, perform_initialization=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
    )
    with torch.device("meta"), _mamba_ssm_stand_in():
        return build_module(mamba_layer_spec(), config=config, layer_number=1,
                            pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp", "pp", "cp"]))


@contextlib.contextmanager
def _as_tp_cp_rank(tp: int, cp: int):
    """Rank 0 of a TP x CP job (fake process group, megatron's initialize_model_parallel) -- as
    nest_megatron.trace.meta.as_rank, which has no CP, then torn down."""
    from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron
    from nest_megatron.trace.meta import teardown_distributed

    prepare_cpu_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    teardown_distributed()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     create_gloo_process_groups=False)
        yield
    finally:
        teardown_distributed()


def mamba_layer_params(*, hidden, state_dim, head_dim, num_groups, num_heads=None, tp=1, cp=1, fp8=None) -> int:
    """Parameters on one TP x CP rank of megatron-core's MambaLayer (its pre-norm included)."""
    with warnings.catch_warnings(action="ignore"), _as_tp_cp_rank(tp, cp):
        layer = build_meta_mamba_layer(hidden=hidden, state_dim=state_dim, head_dim=head_dim,
                                       num_groups=num_groups, num_heads=num_heads, tp=tp, fp8=fp8)
        return sum(p.numel() for p in layer.parameters())


def mamba_projection_gemms(*, hidden, state_dim, head_dim, num_groups, num_heads=None, tp=1, tokens=128):
    """MambaMixer's two GEMMs on rank 0 of a TP-`tp` job, as megatron-core builds and runs them: for in_proj
    (ColumnParallelLinear) and out_proj (RowParallelLinear), (name, its weight's [out, in] shape, the FLOPs
    FlopCounterMode counts for that module's own forward on one sequence of `tokens` on the meta device).
    Only the two linear modules run: the mixer's forward between them is the fused Triton scan (above)."""
    from torch.utils.flop_counter import FlopCounterMode

    gemms = []
    with warnings.catch_warnings(action="ignore"), _as_tp_cp_rank(tp, 1):
        mixer = build_meta_mamba_layer(hidden=hidden, state_dim=state_dim, head_dim=head_dim,
                                       num_groups=num_groups, num_heads=num_heads, tp=tp).mixer
        for name in ("in_proj", "out_proj"):
            module = getattr(mixer, name)
            out_features, in_features = module.weight.shape
            x = torch.empty(tokens, 1, in_features, device="meta", dtype=torch.bfloat16)  # [s, b, in]
            with FlopCounterMode(display=False) as counter:
                y, _ = module(x)
            assert y.shape == (tokens, 1, out_features if name == "in_proj" else hidden)
            gemms.append((name, (out_features, in_features), counter.get_total_flops()))
    return gemms
