"""Qwen3 (dense) against Hugging Face on tiny random models: per-head q/k norms, attention biases, head_dim apart from
hidden_size / heads, sliding-window layers, and the yarn and dynamic rope types; then the engine's paths that touch
the model (tests/families.py)."""

import families
import pytest

from test_models import COMMON

SHAPE = {**COMMON, "head_dim": 32, "tie_word_embeddings": False}


def rope(rope_type, **params):
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **params}}


VARIANTS = {
    "plain": {},
    # Biases on q, k, v and o; full attention on layer 0, a 16-token window on layer 1.
    "bias-window": dict(attention_bias=True, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "yarn": rope("yarn", factor=4.0, original_max_position_embeddings=64),
    # DeepSeek-style mscale (attention factor from mscale / mscale_all_dim) and narrower correction bounds.
    "yarn-mscale": rope(
        "yarn",
        factor=8.0,
        original_max_position_embeddings=32,
        mscale=0.7,
        mscale_all_dim=1.0,
        beta_fast=16,
        beta_slow=2,
    ),
    # Transformers changes dynamic NTK's frequencies only past max_position_embeddings, which the engine never serves.
    "dynamic": rope("dynamic", factor=2.0),
}


def config(variant="plain"):
    import transformers

    return transformers.Qwen3Config(**{**SHAPE, **VARIANTS[variant]})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_with_chunked_prefill_and_prefix_hits(tmp_path, variant):
    families.check_greedy_chunked_and_prefix_cached(tmp_path, config(variant))


def test_preemption_structured_output_speculation_tp_lora_and_kv_store(tmp_path, redis_server):
    lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    families.check_engine_paths(tmp_path, config("bias-window"), redis_server.url, lora_targets)
