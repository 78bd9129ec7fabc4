"""model.source=hf with the Hub's config.json of each shipped 2025 model (tests/hf_configs/): the same keys as the
shipped config, the same plan with the same (Transformer Engine) kernels, local kernels only when asked, and one
line for a config.json the planner cannot price."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nest_megatron import api, cli
from nest_megatron.config.load import load
from nest_megatron.errors import NestError

CONFIGS = Path(__file__).with_name("hf_configs")
SHIPPED = sorted(path.stem for path in CONFIGS.glob("*.json"))
# Where a composed model came from, not what it is
ORIGIN = ("name", "source", "hf_config")


def _fields(model) -> dict:
    return {k: v for k, v in dataclasses.asdict(model).items() if k not in ORIGIN}


def test_every_shipped_2025_model_has_its_config_json():
    assert SHIPPED == ["deepseek_v3", "gpt_oss_120b", "kimi_k2", "llama31_405b", "nemotron_h_56b", "qwen3_235b_a22b",
                       "qwen3_30b_a3b"]


@pytest.mark.parametrize("name", SHIPPED)
def test_the_config_json_reads_into_the_shipped_keys(name):
    """Composed on the shipped config, so its run choices (seq_length, vocabulary padding, ...) are the shipped
    ones; every architecture key comes from the file (the reader builds the rest from ModelConfig's defaults)."""
    shipped = load([f"model={name}"]).config.model
    read = load([f"model={name}", "model.source=hf", f"model.hf_config={CONFIGS / name}.json"]).config.model
    assert _fields(read) == _fields(shipped)


def test_a_llama_config_json_plans_as_the_shipped_llama(tmp_path):
    """The issue's case: Llama 3 8B from its config.json was planned with megatron-core's local spec (unfused
    kernels, --transformer-impl local), a slower plan than the shipped llama3_8b's. Now the same plan."""
    hf = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
          "attention_bias": False, "attention_dropout": 0.0}  # meta-llama/Meta-Llama-3-8B's architecture keys
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    cells = ["cluster=dgx_h100_superpod", "cluster.num_devices=64"]
    read = api.plan(["model=llama3_8b", "model.source=hf", f"model.hf_config={path}", *cells])
    shipped = api.plan(["model=llama3_8b", *cells])
    assert read.megatron_args == shipped.megatron_args and "--transformer-impl" not in read.megatron_args
    assert read.predicted["step_time_s"] == shipped.predicted["step_time_s"]


def test_local_kernels_only_when_asked():
    name = "qwen3_30b_a3b"
    keys = [f"model={name}", "model.source=hf", f"model.hf_config={CONFIGS / name}.json"]
    assert load(keys).problem.model.tracer is None  # the formulas, Transformer Engine's layers
    local = load([*keys, "model.transformer_impl=local"])
    assert local.problem.model.tracer is not None  # megatron-core's local spec, traced on the meta device
    assert local.config.model.attention_backend == "unfused"


@pytest.mark.parametrize("name, change, message", [
    # full attention on layers 1, 3, 5, ... counted from 1: no N has exactly those as its multiples
    ("gpt_oss_120b", {"layer_types": ["full_attention", "sliding_attention"] * 18},
     "gpt_oss layer_types: the planner prices full attention every N-th layer and a window elsewhere"),
    ("nemotron_h_56b", {"num_nextn_predict_layers": 1},
     "nemotron_h num_nextn_predict_layers 1 with MTP layers '': give mtp_layers_block_type"),
    ("nemotron_h_56b", {"mlp_hidden_act": "silu"},
     "nemotron_h mlp_hidden_act 'silu': the planner prices Nemotron-H's relu2"),
    ("deepseek_v3", {"kv_lora_rank": None}, "deepseek_v3 needs kv_lora_rank as an integer >= 1, found None"),
    ("qwen3_30b_a3b", {"decoder_sparse_step": 0}, "qwen3_moe needs decoder_sparse_step as an integer >= 1, found 0"),
    ("qwen3_30b_a3b", {"use_sliding_window": True}, "qwen3_moe use_sliding_window true: Qwen3's sliding window"),
    ("gpt_oss_120b", {"layer_types": ["sliding_attention", "full_attention"] * 10},
     "gpt_oss layer_types: one of sliding_attention, full_attention for each of the 36 layers"),
])
def test_a_config_json_the_planner_cannot_price_is_one_line(tmp_path, name, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads((CONFIGS / f"{name}.json").read_text()), **change}))
    with pytest.raises(NestError, match=f"^model.hf_config={path}: {message}"):
        load([f"model={name}", "model.source=hf", f"model.hf_config={path}"])


def test_gpt_oss_default_layer_types_slide_every_other_layer(tmp_path):
    """Without layer_types, GPT-OSS slides on layers 0, 2, ... (configuration_gpt_oss.py:84-87): full attention on
    every 2nd layer counted from 1, Megatron's --window-attn-skip-freq 2, over 128 tokens, the token and 127 before."""
    data = json.loads((CONFIGS / "gpt_oss_120b.json").read_text())
    del data["layer_types"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    model = load(["model=gpt_oss_120b", "model.source=hf", f"model.hf_config={path}"]).config.model
    assert (model.window_size, model.window_attn_skip_freq) == (127, 2)


def test_a_nemotron_h_moe_config_reads_its_experts_and_latent(tmp_path):
    """Nemotron-3 Super's MoE keys as Megatron-Bridge's NemotronHBridge test gives them (tests/unit_tests/models/
    nemotronh/test_nemotron_h_bridge.py test_provider_bridge_moe_latent_size): 512 experts of 2688, top 22, one shared
    MLP of 5376, latent 1024, no group limit; the blocks as layers_block_type names."""
    data = {**json.loads((CONFIGS / "nemotron_h_56b.json").read_text()), "n_routed_experts": 512,
            "moe_intermediate_size": 2688, "moe_shared_expert_intermediate_size": 5376, "num_experts_per_tok": 22,
            "n_group": 1, "topk_group": 1, "moe_latent_size": 1024}
    del data["hybrid_override_pattern"]
    data["layers_block_type"] = ["mamba", "moe", "mamba", "attention"] * 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    model = load(["model=nemotron_h_56b", "model.source=hf", f"model.hf_config={path}"]).config.model
    assert model.hybrid_layer_pattern == "MEM*MEM*" and model.num_layers == 8
    assert (model.num_experts, model.moe_router_topk, model.moe_ffn_hidden_size,
            model.moe_shared_expert_intermediate_size, model.moe_latent_size, model.moe_router_num_groups) == (
        512, 22, 2688, 5376, 1024, None)


def test_deepseek_experts_every_moe_layer_freq_th_layer_after_the_dense_ones(tmp_path):
    """DeepSeek's own modeling code puts experts in layer i when i >= first_k_dense_replace and i % moe_layer_freq ==
    0 (transformers reads no moe_layer_freq: 1): with 1 dense layer and a frequency of 2 over 6 layers, layers 2 and
    4."""
    data = {**json.loads((CONFIGS / "deepseek_v3.json").read_text()), "num_hidden_layers": 6,
            "first_k_dense_replace": 1, "moe_layer_freq": 2, "num_nextn_predict_layers": 0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    model = load(["model=deepseek_v3", "model.source=hf", f"model.hf_config={path}"]).config.model
    assert model.moe_layer_freq == [0, 0, 1, 0, 1, 0] and model.mtp_num_layers is None


def test_nemotron_h_blocks_come_before_the_legacy_pattern(tmp_path):
    """transformers reads hybrid_override_pattern only where layers_block_type is not given
    (configuration_nemotron_h.py:171-174)."""
    data = {**json.loads((CONFIGS / "nemotron_h_56b.json").read_text()),
            "layers_block_type": ["mamba", "mlp", "attention", "mlp"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert load(["model=nemotron_h_56b", "model.source=hf", f"model.hf_config={path}"]).config.model.hybrid_layer_pattern == "M-*-"


def test_nemotron_h_mtp_layers_read_as_a_hybrid_depth(tmp_path):
    """num_nextn_predict_layers depths of mtp_layers_block_type's blocks (AutoModel's Nemotron-3 reads it, its
    examples/llm_benchmark/nemotron/nemotron_ultra_v3_te_deepep.yaml at 36044ad3), else mtp_hybrid_override_pattern."""
    data = {**json.loads((CONFIGS / "nemotron_h_56b.json").read_text()), "num_nextn_predict_layers": 2,
            "mtp_layers_block_type": ["attention", "mlp"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    model = load(["model=nemotron_h_56b", "model.source=hf", f"model.hf_config={path}"]).config.model
    assert (model.mtp_num_layers, model.mtp_hybrid_pattern, model.mtp_use_repeated_layer) == (2, "*-", False)
    del data["mtp_layers_block_type"]
    path.write_text(json.dumps({**data, "mtp_hybrid_override_pattern": "*-"}))
    assert load(["model=nemotron_h_56b", "model.source=hf", f"model.hf_config={path}"]).config.model.mtp_hybrid_pattern == "*-"


def test_trace_builds_a_config_json_as_megatron_core_s_local_spec(capsys):
    """`trace` builds megatron-core's local spec: a hybrid stack, which that spec has not, is one line (it was traced
    as a dense stack when hf was priced with Transformer Engine's layers and trace did not ask for local)."""
    path = CONFIGS / "nemotron_h_56b.json"
    assert cli.main(["trace", "model=nemotron_h_56b", "model.source=hf", f"model.hf_config={path}"]) == 2
    assert "model.transformer_impl=local with model.hybrid_layer_pattern" in capsys.readouterr().err
