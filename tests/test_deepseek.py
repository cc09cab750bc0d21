"""DeepSeek-V2 (DeepseekV2ForCausalLM) against Hugging Face on tiny random models: multi-head latent attention with
q_lora_rank None and set, YaRN rope whose mscale scales both the rope and the softmax, dense layers before
first_k_dense_replace and routed (greedy or group-limited) plus shared experts after; its KV cache is one latent
vector per token and layer; then the engine's paths that touch the model (tests/families.py)."""

import families
import pytest
import torch
from test_gemma2 import check_greedy_and_logprobs

from conftest import HFReference, assert_greedy_matches
from engine.models.config import ModelArchConfig, ModelLoadError
from test_models import COMMON

KV_LORA_RANK, QK_ROPE = 32, 8
DEEPSEEK_V2 = {
    **COMMON,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "kv_lora_rank": KV_LORA_RANK,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": QK_ROPE,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.5,
    # DeepSeek-V2's own rope: YaRN over an original context shorter than the prompts, mscale != mscale_all_dim so
    # that both the cos/sin factor and the softmax's mscale squared differ from 1.
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
}

VARIANTS = {
    "q-lora-group-limited": dict(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=2, topk_group=1, attention_bias=True
    ),
    "no-q-lora-greedy": {},
    # Every layer dense, and the default rope.
    "dense-default-rope": dict(first_k_dense_replace=3, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}


def deepseek_v2(variant="q-lora-group-limited", **extra):
    import transformers

    return transformers.DeepseekV2Config(**{**DEEPSEEK_V2, **VARIANTS[variant], **extra})


def arch_config(config, **changes) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config({**config.to_dict(), "architectures": ["DeepseekV2ForCausalLM"], **changes})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepseek_v2_greedy_and_logprobs_match_hf(tmp_path, variant):
    """Prompts of 40 and 7 tokens prefilled in chunks (a later chunk up-projects the cached latents), 24 decode steps
    each (the absorbed form), and a prompt whose first 32 tokens come from the prefix cache."""
    check_greedy_and_logprobs(tmp_path, deepseek_v2(variant))


def test_deepseek_v2_kv_cache_is_one_latent_vector_per_token_and_layer(tmp_path):
    config = deepseek_v2()
    path, _ = families.save_family_model(tmp_path, config)
    engine = families.make_engine(path)
    latent_block = families.BLOCK * (KV_LORA_RANK + QK_ROPE) * 4  # float32, no heads, no separate V
    assert engine.executor.get_cache_block_size_bytes() == config.num_hidden_layers * latent_block
    assert families.block_bytes(config) == config.num_hidden_layers * latent_block
    (cache, *_) = engine.executor.driver_worker.kv_caches
    assert cache.shape == (engine.num_blocks, families.BLOCK, KV_LORA_RANK + QK_ROPE)


@pytest.mark.parametrize(
    "check",
    [
        families.check_greedy_chunked_and_prefix_cached,
        families.check_preemption,
        families.check_structured_output,
        families.check_ngram_speculation,
        families.check_tensor_parallel,
    ],
)
def test_deepseek_v2_engine_paths(tmp_path, check):
    check(tmp_path, deepseek_v2())


def test_deepseek_v2_on_the_torch_backend_by_name(tmp_path):
    config = deepseek_v2("no-q-lora-greedy")
    path, hf_model = families.save_family_model(tmp_path, config)
    engine = families.make_engine(path, attention_backend="torch")
    prompt = families.prompts(config, (20,))
    ours = families.run_greedy(engine, prompt, 8)[0]
    ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt[0], 8)
    assert_greedy_matches(ours, ref_tokens, ref_logits, "torch backend")


def test_head_dim_is_the_rope_part_where_a_config_json_lacks_it():
    d = deepseek_v2().to_dict()
    del d["head_dim"]
    config = arch_config(deepseek_v2(), head_dim=None)
    assert config.head_dim == QK_ROPE and config.kv_lora_rank == KV_LORA_RANK
    assert ModelArchConfig.from_hf_config({**d, "architectures": ["DeepseekV2ForCausalLM"]}).head_dim == QK_ROPE


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("topk_method", "noaux_tc", "noaux_tc"),
        ("norm_topk_prob", True, "True"),
        ("num_key_value_heads", 2, "2"),
        ("n_group", 3, "3"),
        ("topk_group", 5, "5"),
        ("num_experts_per_tok", 9, "9"),
        ("scoring_func", "sigmoid", "sigmoid"),
        ("moe_layer_freq", 2, "2"),
    ],
)
def test_deepseek_v2_unimplemented_values_are_refused(field, value, shown):
    with pytest.raises(ModelLoadError, match=field) as refused:
        arch_config(deepseek_v2(), **{field: value})
    assert shown in str(refused.value)


# DeepSeek-V3's router: sigmoid scores over 4 groups of 2 experts, of which 2 groups are kept, a correction bias on
# the choice (drawn at random below: transformers initialises it to zeros).
V3_VARIANTS = {
    "interleaved-normalised": dict(q_lora_rank=24, norm_topk_prob=True),
    "rotate-half-unnormalised": dict(rope_interleave=False, norm_topk_prob=False),
}


def deepseek_v3(variant):
    import transformers

    base = {k: v for k, v in DEEPSEEK_V2.items() if k not in ("first_k_dense_replace",)}
    # architectures and dtype as saving writes them, so that the config (the saved model's key) stays as it is.
    fields = {**base, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, **V3_VARIANTS[variant]}
    return transformers.DeepseekV3Config(**fields, architectures=["DeepseekV3ForCausalLM"], dtype="float32")


def save_v3_with_random_bias(tmp_path, config):
    """The saved model with each router's e_score_correction_bias drawn at random, large enough to change choices."""
    path, hf_model = families.save_family_model(tmp_path, config)
    assert families.save_family_model(tmp_path, config)[0] == path  # what the checks below load
    gen = torch.Generator().manual_seed(2)
    for name, buffer in hf_model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)
    hf_model.save_pretrained(path)
    return path, hf_model


@pytest.mark.parametrize("variant", sorted(V3_VARIANTS))
def test_deepseek_v3_greedy_and_logprobs_match_hf(tmp_path, variant):
    config = deepseek_v3(variant)
    save_v3_with_random_bias(tmp_path, config)
    check_greedy_and_logprobs(tmp_path, config)


def test_deepseek_v3_engine_paths(tmp_path):
    config = deepseek_v3("interleaved-normalised")
    save_v3_with_random_bias(tmp_path, config)
    families.check_greedy_chunked_and_prefix_cached(tmp_path, config)
    families.check_tensor_parallel(tmp_path, config)


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("n_group", 8, "8"),  # groups of one expert: a group's score is its two best
        ("topk_group", 5, "5"),
        ("num_experts_per_tok", 5, "5"),  # more than the 2 kept groups' 4 experts
        ("scoring_func", "softmax", "softmax"),
        ("topk_method", "greedy", "greedy"),
    ],
)
def test_deepseek_v3_unimplemented_values_are_refused(field, value, shown):
    d = {**deepseek_v3("interleaved-normalised").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    with pytest.raises(ModelLoadError, match=field) as refused:
        ModelArchConfig.from_hf_config({**d, field: value})
    assert shown in str(refused.value)
