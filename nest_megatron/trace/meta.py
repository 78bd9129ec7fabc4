"""A megatron-core GPTModel built on the meta device (no memory, no GPU), as one rank of a TP x PP
x EP job, and its layer graph from one forward pass.

One process poses as any rank: a `fake` process group (collectives return at once, nothing is
sent) and megatron's own initialize_model_parallel, so megatron computes this rank's coordinates,
group sizes and shard shapes itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from dataclasses import replace

from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.layer_graph import LayerGraph
from nest_megatron.model.spec import ModelSpec
from nest_megatron.trace.cpu_megatron import meta_cuda_is_identity, prepare_cpu_megatron
from nest_megatron.trace.record import record_layers
from nest_megatron.trace.transformer_config import transformer_config

LAYER_SPECS = ("local", "te")


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def teardown_distributed() -> None:
    """Forget megatron's parallel state and the process group, whatever set them up."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def as_rank(rank: int, world: int, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
            order: str = "tp-cp-ep-dp-pp"):
    """Make this process rank `rank` of a `world`-rank job (fake process group)."""
    prepare_cpu_megatron()  # first: it imports megatron-core (quickly, patch 0)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    teardown_distributed()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            order=order,
            create_gloo_process_groups=False,
        )
        yield
    finally:
        teardown_distributed()


def decoder_spec(cfg: ModelConfig, config, spec: str = "local"):
    """megatron-core's decoder block spec with `local` (plain torch) or `te` (Transformer Engine)
    layers: dense and MoE layers as model.moe_layer_freq says (MLA with --multi-latent-attention), this
    pipeline stage's share."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec not in LAYER_SPECS:
        raise NestError(f"layer spec {spec}: allowed are {', '.join(LAYER_SPECS)}")
    if spec == "te" and not have_transformer_engine():
        raise NestError("layer spec te: transformer_engine does not import here; use the local spec")
    return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=spec == "te",
                                                      normalization=cfg.normalization)


def build_meta_gpt(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                   num_layers: int | None = None, spec: str = "local", sequence_parallel: bool = False):
    """This rank's GPTModel on the meta device, in bf16 as Megatron trains it (Float16Module casts
    every parameter, the norms' too); call inside `as_rank`. Returns (model, TransformerConfig).

    The vocabulary is padded as Megatron-LM's training code does before it builds the model
    (megatron/training/tokenizer: multiple of make_vocab_size_divisible_by x TP; that function
    is not part of megatron-core), i.e. ModelSpec.padded_vocab(tp)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    config = transformer_config(cfg, tp=tp, pp=pp, ep=ep, etp=etp, num_layers=num_layers,
                                sequence_parallel=sequence_parallel)
    with meta_cuda_is_identity(), torch.device("meta"):
        layers = decoder_spec(cfg, config, spec)
        # The multi-token-prediction depths (on the last stage), each of the decoder's last layer spec.
        mtp = (get_gpt_mtp_block_spec(config, layers, use_transformer_engine=spec == "te")
               if cfg.mtp_num_layers else None)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layers,
            mtp_block_spec=mtp,
            vocab_size=ModelSpec(cfg).padded_vocab(tp),
            max_sequence_length=cfg.seq_length,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
        )
    return model.to(torch.bfloat16), config


def trace_megatron(cfg: ModelConfig, *, tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1,
                   stage: int = 0, num_layers: int | None = None, micro_batch_size: int = 1, spec: str = "local",
                   sequence_parallel: bool | None = None, source: str = "megatron") -> LayerGraph:
    """The layer graph of the first rank of pipeline stage `stage` of a TP x EP x PP job (its
    layers; the embedding on the first stage, the output layer on the last) for one forward pass
    of `micro_batch_size` sequences; `num_layers` builds fewer layers than the model has (one of
    each kind is enough for the cost model). Sequence parallel defaults to on with TP > 1, as
    Megatron-LM requires for MoE and the planner chooses by default."""
    etp = etp or 1
    sp = tp > 1 if sequence_parallel is None else sequence_parallel and tp > 1
    per_stage = _world(tp, ep, etp)
    try:
        # Silenced: megatron's advice for GPU runs (environment variables, fusions, SP) and its imports' notes.
        with (warnings.catch_warnings(action="ignore"),
              as_rank(stage * per_stage, pp * per_stage, tp=tp, pp=pp, ep=ep, etp=etp)):  # order tp-cp-ep-dp-pp
            model, config = build_meta_gpt(cfg, tp=tp, pp=pp, ep=ep, etp=etp, num_layers=num_layers, spec=spec,
                                           sequence_parallel=sp)
            layers = _trace_forward(model, config, cfg, micro_batch_size, moe_in_eval=tp > 1 and not sp)
    except (AssertionError, ValueError, RuntimeError) as err:  # megatron-core refusing the shape
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise NestError(f"megatron-core cannot build {cfg.name} at tp={tp} ep={ep} etp={etp}: {first}") from None
    return LayerGraph(source=source, model=cfg.name, seq_length=cfg.seq_length, micro_batch_size=micro_batch_size,
                      tp=tp, ep=ep, etp=etp, sequence_parallel=sp, pp=pp, stage=stage, layers=layers)


def _trace_forward(model, config, cfg: ModelConfig, micro_batch_size: int, *, moe_in_eval: bool):
    """One training-mode forward pass of a meta GPTModel on token ids (on a later pipeline stage,
    on the hidden states the stage before sends), recorded per layer: the decoder's, then the
    multi-token-prediction depths' (with labels: each depth's loss is part of the forward)."""
    import torch

    seq_length = cfg.seq_length
    model.train()
    mtp_layers = list(model.mtp.layers) if getattr(model, "mtp_process", False) else []
    blocks = [(f"decoder.layers.{i}", _kind_of(layer, mixer=_mixer(cfg)).label) for i, layer in enumerate(model.decoder.layers)]
    blocks += [(f"mtp.layers.{i}", _kind_of(layer.transformer_layer, mixer=_mixer(cfg), mtp=True).label)
               for i, layer in enumerate(mtp_layers)]
    if moe_in_eval:
        # megatron refuses MoE + TP without sequence parallel in training (MoELayer.forward); with
        # the default router (top-k, no aux or z loss) eval mode runs the same ops.
        for layer in [*model.decoder.layers, *(m.transformer_layer for m in mtp_layers)]:
            if type(layer.mlp).__name__ == "MoELayer":
                layer.mlp.eval()
    with torch.device("meta"):
        tokens = torch.zeros(micro_batch_size, seq_length, dtype=torch.long)
        positions = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, seq_length)
        if not model.pre_process:  # [s / tp with SP, b, h] bf16, as the previous stage sends it
            rows = seq_length // config.tensor_model_parallel_size if config.sequence_parallel else seq_length
            model.set_input_tensor(torch.empty(rows, micro_batch_size, config.hidden_size, dtype=torch.bfloat16,
                                               requires_grad=True))

    labels = tokens if cfg.mtp_num_layers else None

    def run():
        with torch.device("meta"):
            return model(tokens, positions, attention_mask=None, labels=labels)

    return record_layers(model, run, blocks)


def _mixer(cfg: ModelConfig) -> str:
    return "mla" if cfg.multi_latent_attention else "attention"


def _kind_of(layer, *, mixer: str, mtp: bool = False) -> LayerKind:
    """The kind of a built megatron-core TransformerLayer: its MLP a MoELayer or a dense MLP."""
    return LayerKind(mixer, "moe" if type(layer.mlp).__name__ == "MoELayer" else "dense", mtp=mtp)


def representative_layers(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with one decoder layer of each kind, in the order they first appear, and its last layer's kind last
    (what its multi-token-prediction depths are built of), and at most one depth."""
    spec = ModelSpec(cfg)
    kinds = list(spec.kinds)
    if kinds[-1] != spec.layer_kinds[-1]:
        kinds.append(spec.layer_kinds[-1])
    freq = [int(kind.is_moe) for kind in kinds] if cfg.num_experts else 1
    return replace(cfg, num_layers=len(kinds), moe_layer_freq=freq,
                   mtp_num_layers=1 if cfg.mtp_num_layers else None)


def _world(tp: int, ep: int, etp: int) -> int:
    """The smallest world (one pipeline stage) in which TP x DP ranks regroup as ETP x EP x
    expert-DP: a multiple of both tp and ep x etp."""
    import math

    return math.lcm(tp, ep * etp)


def trace_for_cost(cfg: ModelConfig, *, tp: int, ep: int, etp: int, source: str = "megatron") -> LayerGraph:
    """One layer of each kind the model has (what the cost model reads), traced at (tp, ep, etp),
    with the part of its saved bytes that does not grow with the micro-batch: 2 x saved(b = 1) -
    saved(b = 2), from a second trace. The model is built with `representative_layers` and one
    multi-token-prediction depth where it has them."""
    small = representative_layers(cfg)
    one, two = (trace_megatron(small, tp=tp, ep=ep, etp=etp, micro_batch_size=b, source=source) for b in (1, 2))
    return replace(one, layers=tuple(replace(a, fixed_saved_bytes=2 * a.saved_bytes - b.saved_bytes)
                                     for a, b in zip(one.layers, two.layers)))
