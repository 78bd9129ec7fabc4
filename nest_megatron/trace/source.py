"""model.source -> the ModelConfig the cost model reads and the tracer that supplies its layers.

analytic: the formulas alone. hf: the architecture of a Hugging Face config.json, priced as the shipped configs are
(the formulas, Transformer Engine's layers); with model.transformer_impl=local, traced as megatron is. megatron:
megatron-core's GPTModel (local layer spec) traced on the meta device at each (tp, ep, etp) the planner asks about,
one layer of each kind, once each. module: a generic nn.Module, traced at TP = EP = 1; other widths use the analytic
formulas.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.model.layer_graph import LayerGraph

SOURCES = ("analytic", "megatron", "hf", "module")


def _check(cfg: ModelConfig) -> None:
    if cfg.source not in SOURCES:
        raise NestError(f"model.source={cfg.source}: allowed are {', '.join(SOURCES)}")
    if cfg.source == "hf" and not cfg.hf_config:
        raise NestError("model.source=hf: set model.hf_config=PATH (a Hugging Face config.json)")
    if cfg.source == "module" and not cfg.module:
        raise NestError("model.source=module: set model.module=pkg.mod:factory")
    if cfg.hf_config and cfg.source != "hf":
        raise NestError(f"model.hf_config={cfg.hf_config}: read only with model.source=hf (source is {cfg.source})")
    if cfg.module and cfg.source != "module":
        raise NestError(f"model.module={cfg.module}: read only with model.source=module (source is {cfg.source})")


def local_spec_kernels(cfg: ModelConfig) -> ModelConfig:
    """What megatron-core's local layer spec runs, which the traced numbers describe: the unfused
    DotProductAttention (it keeps the softmax), the unfused SwiGLU, MLA's down projections split over TP."""
    return replace(cfg, attention_backend="unfused", bias_swiglu_fusion=False, transformer_impl="local")


def _megatron_tracer(cfg: ModelConfig, tp: int, ep: int, etp: int) -> LayerGraph:
    from nest_megatron.trace.meta import trace_for_cost

    return trace_for_cost(cfg, tp=tp, ep=ep, etp=etp, source=cfg.source)


def _module_tracer(cfg: ModelConfig, tp: int, ep: int, etp: int) -> LayerGraph | None:
    from nest_megatron.trace.module import trace_module

    return trace_module(cfg.module, seq_length=cfg.seq_length, name=cfg.name) if (tp, ep, etp) == (1, 1, 1) else None


def resolve(cfg: ModelConfig):
    """(ModelConfig, tracer or None) for `cfg.source`; one NestError line on bad input."""
    _check(cfg)
    if cfg.source == "analytic":  # the formulas, of the kernels the layer spec runs
        return (local_spec_kernels(cfg) if cfg.transformer_impl == "local" else cfg), None
    if cfg.source == "module":
        from nest_megatron.trace.module import load_factory

        load_factory(cfg.module)  # fail at load, not in the middle of a search
        if cfg.num_experts:
            raise NestError("model.source=module: a generic module is traced as dense blocks; "
                            "unset model.num_experts or use model.source=megatron")
        return cfg, partial(_module_tracer, cfg)
    if cfg.source == "hf":
        from nest_megatron.trace.hf_config import model_config_from_hf

        cfg = model_config_from_hf(cfg.hf_config, cfg)
        if cfg.transformer_impl != "local":  # the kernels users run, as a shipped config of the same model
            return cfg, None
    cfg = local_spec_kernels(cfg)
    return cfg, partial(_megatron_tracer, cfg)
