"""megatron-core 0.16.1's MoE layer with a latent size (TransformerConfig.moe_latent_size), built and run on the meta
device by the project's own tracer (nest_megatron/trace/meta.py), although Transformer Engine does not install here.

MoELayer builds its two latent projections only as Transformer Engine's TELinear (megatron-core 0.16.1
transformer/moe/moe_layer.py:169-193) and asserts HAVE_TE first (:171); moe_layer.py imports TELinear only when
transformer_engine imports (:32-39). `te_latent_projections` sets HAVE_TE and puts `DuplicatedLinearStandIn` where
TELinear would be, for as long as the block runs. The stand-in has TELinear's parameter shapes for
parallel_mode="duplicated": the whole [out, in] weight on every TP rank, no TP split and no collective
(megatron-core 0.16.1 extensions/transformer_engine.py:584-586, 603-608: tp_size 1, no te parallel_mode), and a bias
of `out` where bias=True; its forward is the same GEMM, y = x W^T (+ b), returned as TELinear returns it, (output,
None) with skip_bias_add=False. Everything else the layer runs is megatron-core's own: the router, the alltoall
dispatcher, the local spec's SequentialMLP experts (whose MLPs take the latent width for routed experts,
transformer/mlp.py:117-146), the shared expert."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class DuplicatedLinearStandIn(nn.Module):
    """Stand-in for megatron.core.extensions.transformer_engine.TELinear with parallel_mode="duplicated"."""

    def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias, skip_bias_add,
                 skip_weight_param_allocation, is_expert, **_):
        super().__init__()
        if parallel_mode != "duplicated" or skip_bias_add or skip_weight_param_allocation or is_expert:
            raise NotImplementedError("the stand-in has only the shapes of MoELayer's latent projections")
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        self.bias = nn.Parameter(torch.empty(output_size, dtype=config.params_dtype)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


@contextlib.contextmanager
def te_latent_projections():
    """MoELayer builds its latent projections with the stand-in while this block runs."""
    from unittest import mock

    from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron

    prepare_cpu_megatron()
    from megatron.core.transformer.moe import moe_layer

    with (mock.patch.object(moe_layer, "HAVE_TE", True),
          mock.patch.object(moe_layer, "TELinear", DuplicatedLinearStandIn, create=True)):
        yield
