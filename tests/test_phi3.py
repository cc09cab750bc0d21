"""Phi-3 against Hugging Face on tiny random models: fused qkv_proj and gate_up_proj checkpoints (split per rank under
tensor parallelism), a sliding window on every layer, and LongRoPE up to original_max_position_embeddings (past it
transformers recomputes the whole sequence with the long factors, which the engine does not: it serves that far);
then the engine's paths that touch the model (tests/families.py)."""

import families
import pytest
import torch

from engine.models.config import ModelArchConfig, ModelLoadError
from test_models import COMMON

# Up to where transformers switches to the long factors: the engine serves LongRoPE models that far.
ORIGINAL_LEN = 64
HALF_HEAD = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
_gen = torch.Generator().manual_seed(3)
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=(1 + torch.rand(HALF_HEAD, generator=_gen) * 0.5).tolist(),
    long_factor=(2 + torch.rand(HALF_HEAD, generator=_gen) * 6).tolist(),
)
VARIANTS = {
    "plain": dict(),
    "window": dict(sliding_window=16),
    # The attention factor from max_position_embeddings / original_max_position_embeddings, as Phi-3 configs have it.
    "longrope": dict(rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL_LEN),
    "window-longrope": dict(sliding_window=16, rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL_LEN),
    "longrope-factor": dict(
        rope_parameters={**LONGROPE, "attention_factor": 1.3}, original_max_position_embeddings=ORIGINAL_LEN
    ),
}


def config(variant="plain"):
    import transformers

    return transformers.Phi3Config(**{**COMMON, "pad_token_id": 0, **VARIANTS[variant]})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_with_chunked_prefill_and_prefix_hits(tmp_path, variant):
    families.check_greedy_chunked_and_prefix_cached(tmp_path, config(variant))


def test_preemption_structured_output_speculation_tp_lora_and_kv_store(tmp_path, redis_server):
    # PEFT targets Phi-3's fused qkv_proj and gate_up_proj by those names, which the engine's LoRA refuses by name
    # (test_lora_on_the_fused_projections_is_refused_by_name); o_proj and down_proj are served.
    families.check_engine_paths(tmp_path, config("window-longrope"), redis_server.url, ["o_proj", "down_proj"])


def test_old_rope_type_names_are_longrope_and_partial_rotary_is_refused():
    d = {**config("longrope").to_dict(), "architectures": ["Phi3ForCausalLM"]}
    rope = d.pop("rope_parameters")
    for old in ("su", "yarn"):
        old_style = {**d, "rope_scaling": {**rope, "type": old, "rope_type": None}}
        del old_style["rope_scaling"]["rope_type"]
        scaling = ModelArchConfig.from_hf_config(old_style).rope_scaling
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL_LEN
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor=0\.75"):
        ModelArchConfig.from_hf_config({**d, "rope_parameters": {**rope, "partial_rotary_factor": 0.75}})


def test_longrope_is_served_up_to_the_original_length_and_no_further(tmp_path):
    path, hf_model = families.save_family_model(tmp_path, config("longrope"))
    engine = families.make_engine(path)
    assert engine.max_model_len == ORIGINAL_LEN
    prompt = families.prompts(config(), (ORIGINAL_LEN - 6,))
    ours = families.run_greedy(engine, prompt, 16)
    assert len(ours[0]) == 6  # up to the last position the short factors serve
    families.assert_matches_hf(hf_model, prompt, ours, "up to the original length")
    with pytest.raises(ValueError, match=f"max_model_len={ORIGINAL_LEN + 1} is larger"):
        families.make_engine(path, max_model_len=ORIGINAL_LEN + 1)


def test_lora_on_the_fused_projections_is_refused_by_name(tmp_path):
    """PEFT names Phi-3's fused layers qkv_proj and gate_up_proj; the engine's LoRA serves the unfused names only and
    refuses an adapter on these, naming them, rather than applying part of it."""
    with pytest.raises(ValueError, match=r"target module\(s\) \['gate_up_proj', 'qkv_proj'\] are not supported"):
        families.check_lora(tmp_path, config(), ["qkv_proj", "o_proj", "gate_up_proj"])
