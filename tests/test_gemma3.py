"""Gemma 3 text (Gemma3ForCausalLM) against Hugging Face on a tiny random model: sliding-window layers before a full
one, a window of 16 that prompts and outputs run well past, q/k norms, the sliding layers' rope base apart from the
full layers' linearly scaled one, biases on q/k/v/o, and the engine's paths that touch the model
(tests/families.py)."""

import families
import pytest
from test_gemma2 import ENGINE_PATH_CHECKS, LORA_TARGETS, TINY, arch_config, check_greedy_and_logprobs

from engine.models.config import ModelArchConfig, ModelLoadError
from engine.models.layers import get_rope


def gemma3_config(**extra):
    import transformers

    return transformers.Gemma3TextConfig(
        **{
            **TINY,
            # Two sliding layers to a full one (Gemma 3's own have five, the default pattern): half the work.
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "attention_bias": True,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            **extra,
        }
    )


def test_gemma3_matches_hf_past_its_window(tmp_path):
    config = gemma3_config()
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    check_greedy_and_logprobs(tmp_path, config)


def test_gemma3_soft_caps_as_transformers_applies_them(tmp_path):
    """The final logits are capped; the attention scores are not, though the config names a cap (transformers'
    Gemma 3 never applies it), and no attention backend is asked for one."""
    config = gemma3_config(attn_logit_softcapping=10.0, final_logit_softcapping=20.0)
    assert "logits_soft_cap" not in arch_config(config, "Gemma3ForCausalLM").attention_features()
    check_greedy_and_logprobs(tmp_path, config)


@pytest.mark.parametrize("check", ENGINE_PATH_CHECKS)
def test_gemma3_engine_paths(tmp_path, check):
    check(tmp_path, gemma3_config())


def test_gemma3_lora(tmp_path):
    families.check_lora(tmp_path, gemma3_config(), LORA_TARGETS)


def test_gemma3_kv_store(tmp_path, redis_server):
    families.check_kv_store(tmp_path, gemma3_config(), redis_server.url)


OLD_CONFIG = {
    **TINY,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 13,
    "rope_theta": 500_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "rope_local_base_freq": 5_000.0,
}


@pytest.mark.parametrize("pattern", [None, 4])
def test_gemma3_older_config_reads_as_transformers_does(pattern):
    """A config written before transformers 5: rope_theta and rope_scaling for the full layers, rope_local_base_freq
    for the sliding ones, and a sliding_window_pattern (6 where unsaid) instead of layer_types."""
    import transformers

    from engine.models.gemma3 import Gemma3ForCausalLM

    old = OLD_CONFIG if pattern is None else {**OLD_CONFIG, "sliding_window_pattern": pattern}
    theirs = transformers.Gemma3TextConfig.from_dict(old)
    ours = ModelArchConfig.from_hf_config(old)
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.layer_types.index("full_attention") == (pattern or 6) - 1
    assert (ours.rope_theta, ours.rope_scaling) == (500_000.0, {"rope_type": "linear", "factor": 4.0})
    # As transformers 5 writes it back, one rope a layer type, it reads the same.
    again = ModelArchConfig.from_hf_config({**theirs.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    assert (again.rope_theta, again.rope_scaling, again.layer_types) == (
        ours.rope_theta,
        ours.rope_scaling,
        ours.layer_types,
    )
    for config in (ours, again):
        local = Gemma3ForCausalLM.make_ropes(None, config)["sliding_attention"]
        assert local.cos.equal(get_rope(config.head_dim, config.max_position_embeddings, 5_000.0, None).cos)


def test_gemma3_sliding_layers_rope_is_their_own():
    from engine.models.gemma3 import Gemma3ForCausalLM
    from engine.models.layers import rope_inv_freq

    config = arch_config(gemma3_config(), "Gemma3ForCausalLM")
    ropes = Gemma3ForCausalLM.make_ropes(None, config)
    local, full = ropes["sliding_attention"], ropes["full_attention"]
    assert local is not full
    # Position 1's angles are the inverse frequencies: base 10000 unscaled, and base 1e6 slowed 8 times.
    head_dim = config.head_dim
    assert local.cos[1, : head_dim // 2].allclose(
        rope_inv_freq(head_dim, 10_000.0, None, config.max_position_embeddings).cos()
    )
    assert full.cos[1, : head_dim // 2].allclose(
        (rope_inv_freq(head_dim, 1_000_000.0, None, config.max_position_embeddings) / 8).cos()
    )


@pytest.mark.parametrize(
    "changes, shown",
    [
        (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        (
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            ),
            "sliding_attention rope_type 'linear'",
        ),
    ],
)
def test_gemma3_unimplemented_values_are_refused(changes, shown):
    with pytest.raises(ModelLoadError, match=shown):
        arch_config(gemma3_config(), "Gemma3ForCausalLM", **changes)
