"""Gemma 3 text decoder (Gemma3ForCausalLM): Gemma 2 (gemma2.py) with an RMSNorm over each head's q and k before
RoPE, and a rope of their own for the sliding-window layers (five to each full layer): the full layers' rope is the
model's (rope_theta, rope_scaling), the sliding layers' plain RoPE on their own base. Soft-capping applies only where
the config sets it (Gemma 3's set neither).
"""

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.models.config import ModelArchConfig
from engine.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM
from engine.models.layers import GemmaRMSNorm, RotaryEmbedding, apply_rotary, get_rope


class Gemma3Attention(Gemma2Attention):
    def __init__(
        self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None, layer: int = 0
    ):
        super().__init__(config, backend, quantization, layer)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, kv_cache, metadata: AttentionMetadata, cos_sin):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Each head's q and k normed over head_dim, then rotated.
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, *cos_sin)  # in place
        else:
            q, k = apply_rotary(q, k, *cos_sin)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, metadata)
        return self.o_proj(out.reshape(-1, self.q_size))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention

    def make_ropes(self, config: ModelArchConfig) -> dict[str, RotaryEmbedding]:
        hf = config.hf_config
        # transformers >= 5 writes the sliding layers' base into rope_parameters; older configs as rope_local_base_freq.
        local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
        local_base = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0)
        max_position = config.max_position_embeddings
        return {
            "full_attention": get_rope(config.head_dim, max_position, config.rope_theta, config.rope_scaling),
            "sliding_attention": get_rope(config.head_dim, max_position, local_base, None),
        }
