"""Qwen2-MoE (Qwen2MoeForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM) against Hugging Face on tiny random models:
routed experts with and without renormalised weights, Qwen2-MoE's sigmoid-gated shared expert and q/k/v biases,
Qwen3's q/k norms, dense layers between sparse ones (decoder_sparse_step, mlp_only_layers), sliding windows as each
family places them, the checkpoint's experts per expert (what save_pretrained writes and real checkpoints hold) or
stacked; then the engine's paths that touch the model (tests/families.py), LoRA on the attention projections, and
LoRA on experts refused."""

import copy
import json

import families
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gemma2 import check_greedy_and_logprobs

from conftest import assert_no_leaks, run_greedy
from engine.lora.request import LoRARequest
from engine.models.config import ModelArchConfig, ModelLoadError
from test_models import COMMON

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
QWEN2_MOE = {**COMMON, **MOE, "shared_expert_intermediate_size": 48}
QWEN3_MOE = {**COMMON, **MOE, "head_dim": 32, "norm_topk_prob": True}

QWEN2_VARIANTS = {
    "plain": {},
    # Layers 0 and 2 dense (decoder_sparse_step 2), layer 1 sparse, experts' weights renormalised.
    "sparse-step-2": dict(num_hidden_layers=3, decoder_sparse_step=2, norm_topk_prob=True),
    # Layer 1 dense by mlp_only_layers; no q/k/v biases.
    "mlp-only-no-bias": dict(mlp_only_layers=[1], qkv_bias=False),
    # Qwen2-MoE's window pattern: layers 0 and 2 slide (below max_window_layers, every other one), layer 1 is full.
    "window": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=3),
}
QWEN3_VARIANTS = {
    "plain": {},
    "bias-mlp-only-unnormalised": dict(attention_bias=True, mlp_only_layers=[0], norm_topk_prob=False),
    # Every layer slides in Qwen3-MoE.
    "window": dict(use_sliding_window=True, sliding_window=16),
}


def qwen2_moe(variant="plain"):
    import transformers

    return transformers.Qwen2MoeConfig(**{**QWEN2_MOE, **QWEN2_VARIANTS[variant]})


def qwen3_moe(variant="plain"):
    import transformers

    return transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **QWEN3_VARIANTS[variant]})


@pytest.mark.parametrize("variant", sorted(QWEN2_VARIANTS))
def test_qwen2_moe_greedy_and_logprobs_match_hf(tmp_path, variant):
    check_greedy_and_logprobs(tmp_path, qwen2_moe(variant))


@pytest.mark.parametrize("variant", sorted(QWEN3_VARIANTS))
def test_qwen3_moe_greedy_and_logprobs_match_hf(tmp_path, variant):
    check_greedy_and_logprobs(tmp_path, qwen3_moe(variant))


def test_layer_types_are_read_as_transformers_places_them():
    for config, arch, want in (
        (qwen2_moe("window"), "Qwen2MoeForCausalLM", ("sliding_attention", "full_attention", "sliding_attention")),
        (qwen3_moe("window"), "Qwen3MoeForCausalLM", ("sliding_attention",) * 2),
    ):
        d = {**config.to_dict(), "architectures": [arch]}
        assert ModelArchConfig.from_hf_config(d).layer_types == want
        assert tuple(getattr(config, "layer_types", None) or want) == want
        d.pop("layer_types", None)  # an older config: the family's own pattern
        assert ModelArchConfig.from_hf_config(d).layer_types == want


def rewrite_checkpoint(path, change_config=None, change_tensors=None):
    """A copy of a saved model's directory with its config.json and its tensors changed."""
    import shutil

    copy = path.parent / f"{path.name}-rewritten"
    shutil.copytree(path, copy)
    if change_config:
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps(change_config(config)))
    if change_tensors:
        tensors = load_file(copy / "model.safetensors")
        save_file(change_tensors(tensors), copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def stack_experts(tensors: dict, num_experts: int) -> dict:
    """transformers >= 5's in-memory form: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    out = {}
    for name, t in tensors.items():
        if ".experts.0." in name:
            prefix, proj = name.split(".experts.0.")
            proj = proj.removesuffix(".weight")
            each = [tensors[f"{prefix}.experts.{e}.{proj}.weight"] for e in range(num_experts)]
            out[f"{prefix}.experts.{proj}"] = torch.stack(each)
        elif ".experts." not in name:
            out[name] = t
    for prefix in {n.rsplit(".experts.", 1)[0] for n in out if ".experts.gate_proj" in n}:
        gate, up = out.pop(f"{prefix}.experts.gate_proj"), out.pop(f"{prefix}.experts.up_proj")
        out[f"{prefix}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return out


def test_qwen3_moe_from_a_real_config_and_stacked_experts_matches_hf(tmp_path):
    """Qwen3-MoE's real configs name num_experts (transformers >= 5 writes num_local_experts), and the experts may
    come stacked: the engine reads both, tensor-parallel too."""
    config = qwen3_moe()
    path, hf_model = families.save_family_model(tmp_path, config)

    def real_config(d):
        d["num_experts"] = d.pop("num_local_experts")
        return d

    copy = rewrite_checkpoint(path, real_config, lambda t: stack_experts(t, 8))
    assert "num_local_experts" not in json.loads((copy / "config.json").read_text())
    batch = families.prompts(config)
    for tp in (1, 2):
        engine = families.make_engine(copy, tensor_parallel_size=tp)
        try:
            families.assert_matches_hf(hf_model, batch, run_greedy(engine, batch, families.MAX_TOKENS), f"tp {tp}")
            assert_no_leaks(engine)
        finally:
            engine.shutdown()


def test_qwen2_moe_engine_paths(tmp_path, redis_server):
    families.check_engine_paths(tmp_path, qwen2_moe("mlp-only-no-bias"), redis_server.url, ["q_proj", "v_proj"])


def test_qwen3_moe_engine_paths(tmp_path, redis_server):
    lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    families.check_engine_paths(tmp_path, qwen3_moe("bias-mlp-only-unnormalised"), redis_server.url, lora_targets)


def test_lora_on_experts_is_refused_and_on_a_dense_layer_accepted(tmp_path):
    """PEFT's adapter on down_proj of a Qwen3-MoE adapts its experts' stacked weights too: refused, naming them. A
    hand-made adapter on the dense layer 0's gate_proj is accepted, one on the sparse layer 1's refused."""
    from peft import LoraConfig, get_peft_model

    config = qwen3_moe("bias-mlp-only-unnormalised")
    path, hf_model = families.save_family_model(tmp_path, config)
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    peft_model.save_pretrained(tmp_path / "peft")
    engine = families.make_engine(path, enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="layers.1.mlp.experts.lora_A.weight' adapts a mixture-of-experts layer"):
        engine.add_lora(LoRARequest("peft", 1, str(tmp_path / "peft")))
    for layer in (0, 1):
        adapter = tmp_path / f"gate-proj-{layer}"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(
            json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]})
        )
        key = f"base_model.model.model.layers.{layer}.mlp.gate_proj.lora_{{}}.weight"
        tensors = {key.format("A"): torch.randn(2, 64), key.format("B"): torch.randn(128, 2)}
        save_file(tensors, adapter / "adapter_model.safetensors")
        request = LoRARequest(adapter.name, 2 + layer, str(adapter))
        if layer == 0:
            assert engine.add_lora(request)
        else:
            with pytest.raises(ValueError, match="layer 1's gate_proj is a mixture-of-experts layer's"):
                engine.add_lora(request)


@pytest.mark.parametrize(
    "arch, field, value, shown",
    [
        ("Qwen2MoeForCausalLM", "num_experts_per_tok", 9, "9"),
        ("Qwen3MoeForCausalLM", "decoder_sparse_step", 0, "0"),
        ("Qwen3MoeForCausalLM", "hidden_act", "gelu", "gelu"),
    ],
)
def test_qwen_moe_unimplemented_values_are_refused(arch, field, value, shown):
    config = qwen2_moe() if arch == "Qwen2MoeForCausalLM" else qwen3_moe()
    with pytest.raises(ModelLoadError, match=field) as refused:
        ModelArchConfig.from_hf_config({**config.to_dict(), "architectures": [arch], field: value})
    assert shown in str(refused.value)
