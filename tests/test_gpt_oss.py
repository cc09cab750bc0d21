"""gpt-oss (GptOssForCausalLM) against Hugging Face on tiny random models: sliding-window layers (a window of 16 that
prompts and outputs run past) between full ones, YaRN rope, attention sinks, q/k/v and o_proj biases, the biased
router and the experts' biases and clamped SwiGLU (a limit small enough to clamp); then the engine's paths that touch
the model (tests/families.py), and its config read as transformers reads it."""

import families
import pytest
import torch
from test_gemma2 import check_greedy_and_logprobs, check_saved_greedy_and_logprobs

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


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> MXFP4 blocks [E, rows, cols / 32, 16] and scales [E, rows, cols / 32]: per 32 values the
    power of two that brings the largest within e2m1's 6, and each value's nearest e2m1 code."""
    from engine.models.gpt_oss import _E2M1

    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(_E2M1)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_checkpoint_is_dequantized_as_transformers_dequantizes_it(tmp_path):
    """The released checkpoints' MXFP4 experts, written here from a random model: the engine dequantizes them at
    load, and its greedy output and logprobs equal transformers' on the same checkpoint, dequantized by its own
    Mxfp4Config(dequantize=True)."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    path, _ = families.save_family_model(tmp_path, config())
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    for f in path.iterdir():
        if f.name != "config.json" and f.suffix != ".safetensors":
            (quantized / f.name).symlink_to(f)
    tensors = {}
    for f in path.glob("*.safetensors"):
        for name, tensor in load_file(f).items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
            else:
                tensors[name] = tensor
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    d = json.loads((path / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(d))

    hf_model = transformers.GptOssForCausalLM.from_pretrained(
        quantized, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    check_saved_greedy_and_logprobs(quantized, hf_model, config())


def test_an_mxfp4_checkpoint_of_another_family_is_refused_naming_it(tmp_path):
    import json

    import transformers

    path, _ = families.save_family_model(tmp_path, transformers.LlamaConfig(**COMMON))
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="'mxfp4'.*GptOssForCausalLM, not LlamaForCausalLM"):
        families.make_engine(path)


def test_swigluoai_is_transformers_clamped_swiglu():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from engine.models.fused_moe import swigluoai_and_mul

    experts = GptOssExperts(config(swiglu_alpha=1.5, swiglu_limit=1.0))
    gate_up = torch.randn(5, 64, dtype=torch.float64) * 3
    ours = swigluoai_and_mul(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1), alpha=1.5, limit=1.0)
    assert torch.equal(ours, experts._apply_gate(gate_up))
