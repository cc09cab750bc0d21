"""gpt-oss (GptOssForCausalLM) against Hugging Face on tiny random models: sliding-window layers (a window of 16 that
prompts and outputs run past) between full ones, YaRN rope, attention sinks, q/k/v and o_proj biases, the biased
router and the experts' biases and clamped SwiGLU (a limit small enough to clamp); then the engine's paths that touch
the model (tests/families.py), and its config read as transformers reads it."""

import families
import pytest
import torch
from test_gemma2 import check_greedy_and_logprobs

from engine.models.config import ModelArchConfig, ModelLoadError
from test_models import COMMON

SHAPE = {
    **COMMON,
    "num_hidden_layers": 3,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 16,
    # The experts' activations reach past it, so the clamps change them.
    "swiglu_limit": 2.0,
    # YaRN stretching 64 positions to max_position_embeddings (256).
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
}


def config(**extra):
    import transformers

    return transformers.GptOssConfig(**{**SHAPE, **extra})


def test_gpt_oss_greedy_and_logprobs_match_hf(tmp_path):
    """On the default backend here, the cpu one (its kernel's sinks)."""
    check_greedy_and_logprobs(tmp_path, config())


def test_gpt_oss_on_the_torch_backend_matches_hf(tmp_path):
    families.check_greedy_chunked_and_prefix_cached(tmp_path, config(), attention_backend="torch")


def test_gpt_oss_without_attention_bias_top1_of_four_experts_matches_hf(tmp_path):
    extra = dict(attention_bias=False, num_local_experts=4, num_experts_per_tok=1)
    families.check_greedy_chunked_and_prefix_cached(tmp_path, config(**extra))


def test_gpt_oss_engine_paths(tmp_path, redis_server):
    families.check_engine_paths(tmp_path, config(), redis_server.url, ["q_proj", "k_proj", "v_proj", "o_proj"])


def arch_config(**changes) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config({**config().to_dict(), **changes})


def test_gpt_oss_config_is_read_as_transformers_reads_it():
    arch = arch_config()
    assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert arch.sliding_window == 16 and arch.attention_bias and arch.rope_theta == 10000.0
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["original_max_position_embeddings"] == 64
    assert "sinks" in arch.attention_features() and "sliding_window" in arch.attention_features()


def test_gpt_oss_fields_left_out_take_transformers_defaults():
    import transformers

    d = {"architectures": ["GptOssForCausalLM"], **{k: SHAPE[k] for k in ("vocab_size", "hidden_size")}}
    d.update(num_hidden_layers=4, num_attention_heads=4, intermediate_size=32)
    arch, defaults = ModelArchConfig.from_hf_config(d), transformers.GptOssConfig(num_hidden_layers=4)
    assert arch.layer_types == tuple(defaults.layer_types) and arch.sliding_window == defaults.sliding_window
    assert arch.attention_bias == defaults.attention_bias and arch.rms_norm_eps == defaults.rms_norm_eps
    assert (arch.head_dim, arch.num_key_value_heads) == (defaults.head_dim, defaults.num_key_value_heads)
    assert arch.max_position_embeddings == defaults.max_position_embeddings
    rope = defaults.rope_parameters
    assert arch.rope_theta == rope["rope_theta"] == 150000.0
    assert {k: arch.rope_scaling[k] for k in rope if k != "rope_theta"} == {
        k: rope[k] for k in rope if k != "rope_theta"
    }
    for field in ("num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"):
        assert arch.hf_config[field] == getattr(defaults, field), field


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("num_experts_per_tok", 9, "9"),
        ("num_experts_per_tok", 0, "0"),
        ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"], "chunked_attention"),
        ("rope_parameters", {"rope_type": "proportional", "rope_theta": 1e4, "factor": 4.0}, "proportional"),
    ],
)
def test_gpt_oss_unimplemented_values_are_refused(field, value, shown):
    with pytest.raises(ModelLoadError, match=field.removesuffix("_parameters")) as refused:
        arch_config(**{field: value})
    assert shown in str(refused.value)


def test_gpt_oss_mxfp4_checkpoint_is_refused_naming_its_quantization(tmp_path):
    """The released checkpoints' MXFP4 experts are not dequantized: start-up says so."""
    import json

    path, _ = families.save_family_model(tmp_path, config())
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    for f in path.iterdir():
        (quantized / f.name).symlink_to(f)
    d = json.loads((path / "config.json").read_text())
    (quantized / "config.json").unlink()
    (quantized / "config.json").write_text(json.dumps({**d, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="mxfp4"):
        families.make_engine(quantized)


def test_swigluoai_is_transformers_clamped_swiglu():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from engine.models.fused_moe import swigluoai_and_mul

    experts = GptOssExperts(config(swiglu_alpha=1.5, swiglu_limit=1.0))
    gate_up = torch.randn(5, 64, dtype=torch.float64) * 3
    ours = swigluoai_and_mul(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1), alpha=1.5, limit=1.0)
    assert torch.equal(ours, experts._apply_gate(gate_up))
