"""The Llama-family decoder against Hugging Face on tiny random models of each variant."""

import pytest
import torch

from conftest import HFReference, assert_greedy_matches, assert_no_leaks, run_greedy
from engine.config import EngineArgs
from engine.core import EngineCore

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Large weights make the logits peaky, so greedy choices are far from ties.
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
)

VARIANTS = {
    "llama3-rope-untied": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-qkv-bias": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
}


def save_random_model(tmp_path, variant, max_shard_size=None):
    import transformers

    config_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if variant.startswith("qwen2"):
        with torch.no_grad():  # random, visible biases
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path / variant
    model.save_pretrained(path, max_shard_size=max_shard_size or "5GB")
    return path, model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_model_matches_hf(tmp_path, variant):
    path, hf_model = save_random_model(tmp_path, variant, max_shard_size="200KB")
    if variant == "mistral":
        assert (path / "model.safetensors.index.json").exists()  # sharded checkpoint path
    reference = HFReference(hf_model)
    engine = EngineCore(EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=24))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 90)]
    outputs = run_greedy(engine, prompts, 20)
    for i, (p, ours) in enumerate(zip(prompts, outputs)):
        ref_tokens, ref_logits = reference.greedy(p, 20)
        assert assert_greedy_matches(ours, ref_tokens, ref_logits, f"{variant} prompt {i}")
    assert_no_leaks(engine)


def test_cpu_linear_layers_run_packed_and_keep_only_shared_weights():
    """engine/models/linear.py: oneDNN's packed matmul gives F.linear's result; the plain weight is dropped,
    and a tied lm_head's table stays with the embedding."""
    import torch.nn.functional as F
    from torch import nn

    from engine.models.linear import Linear, VocabParallelEmbedding, process_weights_after_loading, tie_weights

    torch.manual_seed(0)
    model = nn.Module()
    model.embed = VocabParallelEmbedding(40, 24)
    model.proj = Linear(24, 24, bias=True)
    model.head = Linear(24, 40, bias=False)
    tie_weights(model.head, model.embed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    x = torch.randn(5, 24)
    plain_proj, table = model.proj.weight.detach().clone(), model.embed.weight.detach().clone()
    want_proj, want_head = F.linear(x, plain_proj, model.proj.bias), x @ table.T

    process_weights_after_loading(model, torch.float32)
    assert model.proj.weight is None and model.proj.packed is not None
    assert model.head.weight is None and torch.equal(model.embed.weight, table)  # the embedding still needs it
    torch.testing.assert_close(model.proj(x), want_proj, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.head(x), want_head, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.proj(x[:0]), x[:0] @ plain_proj.T)  # an empty step


def test_engine_without_the_cpu_kernels_runs_on_torch(tmp_path, monkeypatch, caplog):
    """A machine that cannot build kernels/cpu (no compiler) still serves, with a warning: attention on the
    torch backend, the layers on torch ops (oneDNN matmuls are torch's own), the same greedy tokens as HF."""
    import logging

    import kernels.cpu_ops

    def no_compiler():
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(kernels.cpu_ops, "load", no_compiler)
    path, hf_model = save_random_model(tmp_path, "qwen2-qkv-bias")
    with caplog.at_level(logging.WARNING):
        engine = EngineCore(EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=8))
    assert engine.worker.attn_backend.name == "torch"
    model = engine.worker.model
    assert model.norm.ops is None and model.layers[0].self_attn.ops is None and model.layers[0].mlp.ops is None
    assert caplog.text.count("no C++ compiler here") == 2  # the attention backend's warning and the layers'
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt, 12)
    assert assert_greedy_matches(run_greedy(engine, [prompt], 12)[0], ref_tokens, ref_logits, "torch fallback")
