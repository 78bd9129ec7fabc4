"""Build one real megatron-core layer (transformer layer, dense or MoE; embedding; output layer with
its cross entropy) for one rank of a sub-graph strategy, and time its forward and backward.

The layers are megatron-core's local spec with the fusions that need Apex / Transformer Engine
off, the settings scripts/pretrain_gpt.py trains with, so a profile describes that training. The
process must already hold megatron's parallel state for the strategy (`parallel_state_for`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from nest_megatron.config.schema import ModelConfig
from nest_megatron.profile.timing import median_seconds
from nest_megatron.trace.cpu_megatron import bind_missing_te_gemm
from nest_megatron.trace.transformer_config import transformer_config as trace_transformer_config

SEED = 1234


def group_world(tp: int, ep: int, etp: int) -> int:
    """Ranks one strategy's TP and expert groups need: TP x DP regroups as expert-TP x EP x expert-DP."""
    return math.lcm(tp, ep * etp)


def teardown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


@contextlib.contextmanager
def fake_group(world: int, *, tp: int, ep: int, etp: int):
    """Rank 0 of a `world`-rank job on a fake process group: megatron builds this rank's shard and
    its collectives return at once (the modelled collective is added instead). The process group
    that was there before (a CPU run's one-rank gloo group) comes back afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    had_group = dist.is_initialized()
    teardown()
    if had_group:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        parallel_state_for(tp=tp, ep=ep, etp=etp)
        yield
    finally:
        teardown()
        dist.destroy_process_group()
        if had_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def parallel_state_for(*, tp: int, ep: int, etp: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    teardown()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def transformer_config(cfg: ModelConfig, *, tp: int, sp: bool, ep: int, etp: int):
    """The tracer's converter (fused kernels off, as scripts/pretrain_gpt.py trains) for one layer,
    with real weight initialisation: uninitialised memory can hold NaNs, which route MoE tokens
    oddly and slow a CPU down."""
    return trace_transformer_config(cfg, tp=tp, ep=ep, etp=etp, num_layers=1, sequence_parallel=sp,
                                    perform_initialization=True)


def _layer(kind: str, cfg: ModelConfig, config, *, vocab: int):
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    if kind == "embedding":
        return LanguageModelEmbedding(config, vocab_size=vocab, max_sequence_length=cfg.seq_length,
                                      position_embedding_type=cfg.position_embedding_type)
    if kind == "output":
        return tensor_parallel.ColumnParallelLinear(cfg.hidden_size, vocab, config=config, init_method=config.init_method,
                                                    bias=False, skip_bias_add=False, gather_output=False)
    if kind == "moe":
        bind_missing_te_gemm()
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts if kind == "moe" else None, moe_grouped_gemm=False,
                                    normalization=cfg.normalization)
    return build_module(spec, config=config, layer_number=1)


def time_layer(kind: str, cfg: ModelConfig, *, tp: int, sp: bool, ep: int, etp: int, mbs: int, vocab: int,
               device: torch.device, warmup: int, repeats: int, before=None) -> tuple[float, float]:
    """(forward + backward, forward) seconds of one `kind` layer of `cfg` on this rank."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    torch.manual_seed(SEED)
    config = transformer_config(cfg, tp=tp, sp=sp, ep=ep, etp=etp)
    module = _layer(kind, cfg, config, vocab=vocab).to(device=device, dtype=torch.bfloat16).train()
    s, h = cfg.seq_length, cfg.hidden_size
    s_local = s // tp if sp else s

    if kind == "embedding":
        tokens = torch.randint(0, cfg.vocab_size, (mbs, s), device=device)
        positions = torch.arange(s, device=device).expand(mbs, -1)

        def forward():
            return module(tokens, positions)
    elif kind == "output":
        hidden = torch.randn(s_local, mbs, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, cfg.vocab_size, (s, mbs), device=device)

        def forward():
            logits, _ = module(hidden)
            return tensor_parallel.vocab_parallel_cross_entropy(logits, labels).mean()
    else:
        hidden = torch.randn(s_local, mbs, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        rope = None
        if cfg.position_embedding_type == "rope":
            rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, use_cpu_initialization=True)(s)
            rope = rope.to(device)

        def forward():
            out, _ = module(hidden, attention_mask=None, rotary_pos_emb=rope)
            return out

    grad = None

    def forward_backward():
        nonlocal grad
        out = forward()
        if grad is None:
            grad = torch.randn_like(out) if out.dim() else torch.ones_like(out)
        out.backward(grad)

    both = median_seconds(forward_backward, device=device, warmup=warmup, repeats=repeats, before=before)
    fwd = median_seconds(forward, device=device, warmup=warmup, repeats=repeats, before=before)
    return both, fwd
