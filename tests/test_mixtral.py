"""Mixtral (MixtralForCausalLM) against Hugging Face on tiny random models: eight SiLU experts a layer, two a token,
with and without a sliding window that prompts and outputs run past; then the engine's paths that touch the model
(tests/families.py), LoRA on the attention projections."""

import families
import pytest
from test_gemma2 import check_greedy_and_logprobs

from engine.models.config import ModelArchConfig, ModelLoadError
from test_models import COMMON

# Experts narrower than the dense MLP, as Mixtral's are.
SHAPE = {**COMMON, "intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2}


def config(**extra):
    import transformers

    return transformers.MixtralConfig(**{**SHAPE, **extra})


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 16}], ids=["full", "window-16"])
def test_mixtral_greedy_and_logprobs_match_hf(tmp_path, extra):
    check_greedy_and_logprobs(tmp_path, config(**extra))


def test_mixtral_top1_of_four_experts_matches_hf(tmp_path):
    families.check_greedy_chunked_and_prefix_cached(tmp_path, config(num_local_experts=4, num_experts_per_tok=1))


def test_mixtral_engine_paths(tmp_path, redis_server):
    families.check_engine_paths(tmp_path, config(), redis_server.url, ["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.mark.parametrize(
    "field, value, shown",
    [("num_experts_per_tok", 9, "9"), ("num_experts_per_tok", 0, "0"), ("hidden_act", "gelu", "gelu")],
)
def test_mixtral_unimplemented_values_are_refused(field, value, shown):
    d = {**config().to_dict(), "architectures": ["MixtralForCausalLM"], field: value}
    with pytest.raises(ModelLoadError, match=field) as refused:
        ModelArchConfig.from_hf_config(d)
    assert shown in str(refused.value)


def test_mixtral_window_is_on_every_layer():
    d = {**config(sliding_window=16).to_dict(), "architectures": ["MixtralForCausalLM"]}
    arch = ModelArchConfig.from_hf_config(d)
    assert arch.sliding_window == 16 and arch.layer_types == ("sliding_attention",) * 2
