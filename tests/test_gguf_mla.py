"""GGUF files of DeepSeek-V2 and V3 (llama.cpp's "deepseek2"), written as llama.cpp's convert_hf_to_gguf.py writes them
from a tiny random Hugging Face model: multi-head latent attention as one KV head with kv_b_proj split into attn_k_b
(transposed) and attn_v_b, or whole as attn_kv_b in older files; the leading dense layers, routed and shared experts,
V2's softmax and V3's sigmoid routing with its exp_probs_b bias, groups, and YaRN with its log multiplier. Served by
the engine and checked against transformers on the weights the file holds; then the variants that are refused."""

import numpy as np
import pytest
import torch
from test_gguf_families import _copy_with, _vocab
from test_gguf_moe import _write, assert_serves_like, base_metadata, random_model

from engine.models import files
from engine.models.config import ModelLoadError
from engine.models.fused_moe import FusedMoE

_SHAPE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    max_position_embeddings=256, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=2, topk_group=1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=271, pad_token_id=269,
)  # fmt: skip
# DeepSeek's own YaRN: mscale equal to mscale_all_dim (as in its released configs, and as llama.cpp computes it).
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip


def _tiny_model(version: str, vocab_size: int):
    import transformers

    if version == "v2":  # V2's group-limited softmax routing, scaled; q_proj without the low-rank path
        config = transformers.DeepseekV2Config(**_SHAPE, vocab_size=vocab_size, q_lora_rank=None,
                                               topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                               rope_parameters=_YARN)  # fmt: skip
    else:  # V3's sigmoid routing with its correction bias, renormalised and scaled; q through q_a and q_b
        config = transformers.DeepseekV3Config(**_SHAPE, vocab_size=vocab_size, q_lora_rank=32, norm_topk_prob=True,
                                               routed_scaling_factor=2.5, rope_parameters=_YARN)  # fmt: skip
    return random_model(config)


def write_deepseek_gguf(path, model, vocab: dict, quantized: bool, split_kv_b: bool = True, skip: str = "") -> dict:
    """`model` as llama.cpp's converter writes it; returns its state dict as the file holds it. Quantized: the experts'
    gate and up as Q4_0, every other tensor of two or more dimensions whose rows are whole blocks as Q8_0 but the
    routers; the rest float32, as the converter leaves what does not quantize."""
    import gguf

    c = model.config
    sigmoid = type(model).__name__ == "DeepseekV3ForCausalLM"
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    rope = c.rope_parameters
    meta = base_metadata(c, vocab) | {
        "head_count_kv": 1,  # MLA as one KV head
        "expert_count": c.n_routed_experts,
        "expert_group_count": c.n_group,
        "expert_group_used_count": c.topk_group,
        "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX,
        "rope_scaling_type": gguf.RopeScalingType.YARN,
        "rope_scaling_factor": rope["factor"],
        "rope_scaling_orig_ctx_len": rope["original_max_position_embeddings"],
        "rope_scaling_yarn_beta_fast": rope["beta_fast"],
        "rope_scaling_yarn_beta_slow": rope["beta_slow"],
        "leading_dense_block_count": c.first_k_dense_replace,
        "vocab_size": c.vocab_size,
        "kv_lora_rank": c.kv_lora_rank,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_shared_count": c.n_shared_experts,
        "expert_weights_scale": c.routed_scaling_factor,
        "rope_dimension_count": c.qk_rope_head_dim,
        "rope_scaling_yarn_log_mul": 0.1 * rope["mscale_all_dim"],
    }
    if split_kv_b:  # the latent's widths, then a head's
        meta |= {"key_length": c.kv_lora_rank + c.qk_rope_head_dim, "value_length": c.kv_lora_rank,
                 "key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim, "value_length_mla": c.v_head_dim}  # fmt: skip
    else:  # older converters: a head's widths
        meta |= {"key_length": c.qk_nope_head_dim + c.qk_rope_head_dim, "value_length": c.v_head_dim}
    if c.q_lora_rank is not None:
        meta["q_lora_rank"] = c.q_lora_rank
    if c.norm_topk_prob:
        meta["expert_weights_norm"] = True
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    q8, q4 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0) if quantized else (None, None)

    def add(hf_name: str, data: np.ndarray, qtype=q8) -> np.ndarray:
        base, _, kind = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{kind}"
        if qtype is None or data.ndim == 1 or data.shape[-1] % 32 or "ffn_gate_inp" in name:
            w.add_tensor(name, data)
            return data
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        return gguf.quants.dequantize(q, qtype)

    heads, nope, v = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    stored = {}
    for hf_name, t in model.state_dict().items():
        data = t.float().numpy()
        prefix = hf_name.rpartition(".")[0]
        if skip and hf_name.endswith(skip):
            continue
        if hf_name.endswith("experts.gate_up_proj"):
            gate, up = np.split(data, 2, axis=1)
            stored[hf_name] = np.concatenate(
                [add(f"{prefix}.gate_proj.weight", gate, q4), add(f"{prefix}.up_proj.weight", up, q4)], axis=1
            )
        elif hf_name.endswith("experts.down_proj"):
            stored[hf_name] = add(f"{hf_name}.weight", data)
        elif hf_name.endswith("e_score_correction_bias"):
            stored[hf_name] = add(f"{prefix}.e_score_correction.bias", data)
        elif hf_name.endswith("kv_b_proj.weight") and split_kv_b:
            k_b, v_b = np.split(data.reshape(heads, nope + v, -1), [nope], axis=1)
            k_b = add(hf_name.replace("kv_b", "k_b"), np.ascontiguousarray(k_b.transpose(0, 2, 1)))
            v_b = add(hf_name.replace("kv_b", "v_b"), np.ascontiguousarray(v_b))
            stored[hf_name] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(data.shape)
        else:
            stored[hf_name] = add(hf_name, data)
    _write(w)
    return {name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for name, a in stored.items()}


def _served(tmp_path, monkeypatch, version: str, quantized: bool, split_kv_b: bool = True):
    vocab = _vocab("qwen3")
    model = _tiny_model(version, len(vocab["tokens"]))
    path = tmp_path / f"deepseek-{version}.gguf"
    model.load_state_dict(write_deepseek_gguf(path, model, vocab, quantized, split_kv_b))
    monkeypatch.setenv("LLMMESH_CACHE_DIR", str(tmp_path / "cache"))
    return path, model


@pytest.mark.parametrize(
    "version, quantized, split_kv_b",
    [("v2", False, True), ("v2", True, False), ("v3", False, True), ("v3", True, True)],
    ids=["v2-f32", "v2-q8_0-q4_0-attn_kv_b", "v3-f32", "v3-q8_0-q4_0"],
)
def test_engine_serving_the_deepseek_gguf_matches_transformers(tmp_path, monkeypatch, version, quantized, split_kv_b):
    from engine.config import EngineArgs
    from engine.core import EngineCore

    path, ref = _served(tmp_path, monkeypatch, version, quantized, split_kv_b)
    hf = ref.config
    config = files.gguf_config(files.open_gguf(path), path)
    assert config["architectures"] == [type(ref).__name__]
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "n_shared_experts", "n_group", "topk_group", "norm_topk_prob", "num_key_value_heads"):  # fmt: skip
        assert config[key] == getattr(hf, key), key
    assert config["routed_scaling_factor"] == pytest.approx(hf.routed_scaling_factor)
    assert config["rope_scaling"]["mscale_all_dim"] == pytest.approx(_YARN["mscale_all_dim"])
    if version == "v2":
        assert config["topk_method"] == "group_limited_greedy"

    engine = EngineCore(EngineArgs(model=str(path), dtype="float32", kv_cache_memory="8MiB", block_size=4))
    layers = [m for m in engine.executor.driver_worker.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2 and all((m.w13_codes is not None) == quantized for m in layers)
    assert_serves_like(engine, ref, f"deepseek {version}")


@pytest.mark.parametrize(
    "version, key, value, message",
    [
        ("v2", "deepseek2.expert_gating_func", 3, "expert_gating_func=3 is not implemented"),
        ("v2", "deepseek2.expert_weights_norm", True, "expert_weights_norm=True is not implemented"),
        ("v2", "deepseek2.expert_shared_count", 0, "expert_shared_count=0 is not implemented"),
        ("v3", "deepseek2.nextn_predict_layers", 1, "nextn_predict_layers=1 is not implemented"),
    ],
)
def test_unimplemented_deepseek_metadata_is_refused_by_name(tmp_path, monkeypatch, version, key, value, message):
    import gguf

    path, _ = _served(tmp_path, monkeypatch, version, quantized=False)
    bad = tmp_path / "bad" / "m.gguf"
    bad.parent.mkdir()
    _copy_with(gguf.GGUFReader(str(path)), bad, {key: value})
    with pytest.raises(ModelLoadError, match=message):
        files.gguf_config(files.open_gguf(bad), bad)


def test_sigmoid_routing_without_its_correction_bias_is_refused(tmp_path):
    vocab = _vocab("qwen3")
    bad = tmp_path / "m.gguf"
    write_deepseek_gguf(bad, _tiny_model("v3", len(vocab["tokens"])), vocab, False, skip="e_score_correction_bias")
    with pytest.raises(ModelLoadError, match="without their exp_probs_b bias"):
        files.gguf_config(files.open_gguf(bad), bad)
