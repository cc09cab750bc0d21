"""KV cache bytes per token under multi-head latent attention (MLA) against the same model with full multi-head K
and V, for DeepSeek-V2-Lite's and DeepSeek-V3's shapes, in bfloat16.

    .venv/bin/python benchmarks/mla_kv_bytes.py

MLA: the engine's own KV cache spec of each layer (engine/kv/kv_cache_spec.py layer_spec on the model's config) and
the KV layout's block shape for one token of one layer (engine/kv/layout.py block_shape): one latent vector of
kv_lora_rank + qk_rope_head_dim, shared by every head. Full multi-head KV, as the model would cache it without the
latent: num_heads x (qk_nope_head_dim + qk_rope_head_dim) for K and num_heads x v_head_dim for V. The configs' shape
numbers are written below (their config.json files); nothing is downloaded.

Then an engine is allocated on a tiny random DeepSeek-V2 with V2-Lite's attention shape (16 heads, kv_lora_rank 512,
qk_rope_head_dim 64; two layers, everything else small), and the bytes of its allocated KV cache tensors per block
are compared with what the spec gives. Runs in seconds.
"""

import sys
import tempfile
from math import prod
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from engine.kv.kv_cache_spec import MLAAttentionSpec, layer_spec
from engine.kv.layout import DTYPE_SIZES, block_shape
from engine.models.config import ModelArchConfig

DTYPE = "bfloat16"

# The attention shapes of deepseek-ai/DeepSeek-V2-Lite's and deepseek-ai/DeepSeek-V3's config.json.
MODELS = {
    "DeepSeek-V2-Lite": dict(
        architecture="DeepseekV2ForCausalLM",
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        # The experts, which the engine's config checks; the KV cache does not depend on them.
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    ),
    "DeepSeek-V3": dict(
        architecture="DeepseekV3ForCausalLM",
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=3,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}


def arch_config(shape: dict) -> ModelArchConfig:
    """The engine's config of a model of this shape (the rest of the config: transformers' defaults)."""
    import transformers

    shape = dict(shape)
    architecture = shape.pop("architecture")
    cls = transformers.DeepseekV2Config if architecture == "DeepseekV2ForCausalLM" else transformers.DeepseekV3Config
    return ModelArchConfig.from_hf_config({**cls(**shape).to_dict(), "architectures": [architecture]})


def mla_bytes_per_token_layer(config: ModelArchConfig) -> int:
    """One token of one layer as the engine caches it: its spec's block of one token, one layer."""
    spec = layer_spec(config, 0)
    assert isinstance(spec, MLAAttentionSpec)
    return prod(block_shape(spec, 1, config.num_key_value_heads, 1, config.head_dim)) * DTYPE_SIZES[DTYPE]


def full_kv_bytes_per_token_layer(shape: dict) -> int:
    k = shape["num_attention_heads"] * (shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"])
    v = shape["num_attention_heads"] * shape["v_head_dim"]
    return (k + v) * DTYPE_SIZES[DTYPE]


def measured_block_bytes() -> tuple[int, int, int, int]:
    """A tiny engine's (block size, layers, its allocated KV bytes per block, the spec's bytes per block)."""
    import transformers

    from engine.config import EngineArgs
    from engine.core import EngineCore
    from random_model import save_word_level_tokenizer

    shape = {k: v for k, v in MODELS["DeepSeek-V2-Lite"].items() if k != "architecture"}
    tiny = dict(
        shape,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-deepseek-v2"
        torch.manual_seed(0)
        config = transformers.DeepseekV2Config(**tiny)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
        save_word_level_tokenizer(path, config.vocab_size)
        args = EngineArgs(model=str(path), dtype=DTYPE, kv_cache_memory="16MiB", block_size=16)
        engine = EngineCore(args)
        try:
            caches = {t.data_ptr(): t for t in engine.executor.driver_worker.kv_caches}
            allocated = sum(t.numel() * t.element_size() for t in caches.values())
            per_block = allocated // engine.num_blocks
            spec_bytes = mla_bytes_per_token_layer(engine.model_config) * 16 * config.num_hidden_layers
        finally:
            engine.shutdown()
    return 16, config.num_hidden_layers, per_block, spec_bytes


def main() -> None:
    print(f"KV cache bytes per token, {DTYPE}\n")
    print(
        "| model | layers | heads | MLA a layer | full K and V a layer | MLA, all layers | full K and V, all layers "
        "| full / MLA |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, shape in MODELS.items():
        config = arch_config(shape)
        mla, full = mla_bytes_per_token_layer(config), full_kv_bytes_per_token_layer(shape)
        layers = config.num_hidden_layers
        print(
            f"| {name} | {layers} | {shape['num_attention_heads']} | {mla:,} B | {full:,} B | {mla * layers:,} B "
            f"| {full * layers:,} B | {full / mla:.1f}× |"
        )
    block_size, layers, measured, expected = measured_block_bytes()
    print(
        f"\nA tiny DeepSeek-V2 of V2-Lite's attention shape ({layers} layers, block size {block_size}): the engine "
        f"allocated {measured:,} B of KV cache per block; the spec gives {expected:,} B "
        f"({expected // (layers * block_size):,} B a token and layer)."
    )
    assert measured == expected


if __name__ == "__main__":
    main()
