"""Gemma 2 (Gemma2ForCausalLM) against Hugging Face on a tiny random model: sliding-window layers between full ones,
with a window of 16 that prompts and outputs run well past, attention and final soft-caps small enough to bite, an
attention scale (query_pre_attn_scalar) other than head_dim's, and the engine's paths that touch the model
(tests/families.py)."""

import families
import pytest
import torch

from conftest import HFReference, assert_greedy_matches, assert_no_leaks
from engine.models.config import ModelArchConfig, ModelLoadError
from engine.request import Request, SamplingParams

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # Large weights make the logits peaky, so greedy choices are far from ties; not so large that the attention
    # scores are beyond the soft cap's reach.
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    sliding_window=16,
)


def gemma2_config(**extra):
    import transformers

    return transformers.Gemma2Config(
        **{
            **TINY,
            "query_pre_attn_scalar": 24,
            # Below the scores' and logits' reach (about 30), so both caps change them; the final one cannot change
            # a greedy choice (tanh keeps the order), only the logprobs.
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 20.0,
            **extra,
        }
    )


def check_greedy_and_logprobs(tmp_path, config, lengths=(40, 7), max_tokens=24):
    """Greedy tokens identical to Hugging Face's and each one's logprob within 1e-3 of the reference's, prompts
    prefilled in chunks; the last prompt begins with the first's blocks, from the prefix cache."""
    path, hf_model = families.save_family_model(tmp_path, config)
    check_saved_greedy_and_logprobs(path, hf_model, config, lengths, max_tokens)


def check_saved_greedy_and_logprobs(path, hf_model, config, lengths=(40, 7), max_tokens=24):
    """check_greedy_and_logprobs on a model saved at path, whose reference is hf_model."""
    engine = families.make_engine(path, max_num_batched_tokens=24)
    batch = families.prompts(config, lengths)
    batch.append(batch[0][:32] + batch[1])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(batch):
        engine.add_request(Request(str(i), prompt, params))
    tokens = {str(i): [] for i in range(len(batch))}
    logprobs = {str(i): [] for i in range(len(batch))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs.logprobs[:, 0].tolist()
    for i, prompt in enumerate(batch):
        ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt, max_tokens)
        ours = tokens[str(i)]
        assert_greedy_matches(ours, ref_tokens, ref_logits, f"prompt {i}")
        same = next((n for n, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b), len(ours))
        ref_logprobs = ref_logits.log_softmax(-1).gather(1, torch.tensor(ref_tokens)[:, None])[:same, 0]
        torch.testing.assert_close(torch.tensor(logprobs[str(i)][:same]), ref_logprobs, atol=1e-3, rtol=0)
    assert_no_leaks(engine)


def test_gemma2_matches_hf_past_its_window_with_soft_caps(tmp_path):
    check_greedy_and_logprobs(tmp_path, gemma2_config())


def test_gemma2_soft_caps_bound_the_logits(tmp_path):
    """The final cap (20) holds every logit inside (-20, 20), and the engine's logprobs there are Hugging Face's."""
    config = gemma2_config()
    path, hf_model = families.save_family_model(tmp_path, config)
    engine = families.make_engine(path, max_logprobs=-1)
    prompt = families.prompts(config, (20,))[0]
    engine.add_request(Request("0", prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=-1)))
    rows = []
    while engine.has_unfinished_requests():
        rows += [out.new_logprobs for out in engine.step()]
    top = rows[0].logprobs[0, 1:]  # the whole vocabulary's logprobs, best first, at the first step
    # Logits within (-cap, cap): no two logprobs are more than 2 * cap apart.
    assert (top[0] - top[-1]).item() < 40.0
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1).sort(descending=True).values
    torch.testing.assert_close(top, ref, atol=1e-3, rtol=0)


# The shared checks Gemma 2 and 3 run (TP 2: their heads and KV heads divide by 2).
ENGINE_PATH_CHECKS = [
    families.check_greedy_chunked_and_prefix_cached,
    families.check_preemption,
    families.check_structured_output,
    families.check_ngram_speculation,
    families.check_tensor_parallel,
]
# Every projection PEFT can target in a Gemma layer.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("check", ENGINE_PATH_CHECKS)
def test_gemma2_engine_paths(tmp_path, check):
    check(tmp_path, gemma2_config())


def test_gemma2_lora(tmp_path):
    families.check_lora(tmp_path, gemma2_config(), LORA_TARGETS)


def test_gemma2_kv_store(tmp_path, redis_server):
    families.check_kv_store(tmp_path, gemma2_config(), redis_server.url)


def arch_config(config, arch: str, **changes) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config({**config.to_dict(), "architectures": [arch], **changes})


def test_gemma2_layers_alternate_where_a_config_has_no_layer_types():
    """Older Gemma 2 configs carry no layer_types: transformers slides on the even layers, full on the odd ones."""
    config = gemma2_config(num_hidden_layers=4)
    assert arch_config(config, "Gemma2ForCausalLM", layer_types=None).layer_types == tuple(config.layer_types)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2


def test_gemma2_fields_left_out_take_transformers_defaults():
    d = gemma2_config().to_dict()
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "hidden_activation"):
        del d[key]
    hf = ModelArchConfig.from_hf_config({**d, "architectures": ["Gemma2ForCausalLM"]}).hf_config
    import transformers

    defaults = transformers.Gemma2Config()
    assert hf["attn_logit_softcapping"] == defaults.attn_logit_softcapping == 50.0
    assert hf["final_logit_softcapping"] == defaults.final_logit_softcapping == 30.0
    assert hf["query_pre_attn_scalar"] == defaults.query_pre_attn_scalar
    assert hf["hidden_activation"] == defaults.hidden_activation


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("hidden_activation", "gelu", "gelu"),
        ("use_bidirectional_attention", True, "True"),
        ("sliding_window", None, "None"),
    ],
)
def test_gemma2_unimplemented_values_are_refused(field, value, shown):
    with pytest.raises(ModelLoadError, match=field) as refused:
        arch_config(gemma2_config(), "Gemma2ForCausalLM", **{field: value})
    assert shown in str(refused.value)


def test_geglu_is_transformers_gelu_pytorch_tanh():
    """The tanh approximation of GELU, as Gemma's MLP has it (the exact GELU differs too little for the end-to-end
    tests to tell apart)."""
    from transformers.activations import ACT2FN

    from engine.models.layers import gelu_tanh_and_mul

    gate, up = torch.randn(2, 8, 32, dtype=torch.float64).unbind()
    ours = gelu_tanh_and_mul(torch.cat([gate, up], dim=-1))
    assert torch.equal(ours, ACT2FN["gelu_pytorch_tanh"](gate) * up)
    assert not torch.allclose(ours, ACT2FN["gelu"](gate) * up, rtol=0, atol=1e-6)
