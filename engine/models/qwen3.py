"""Qwen3 (dense): the Llama decoder with each head of q and k RMS-normalised before RoPE (q_norm, k_norm over
head_dim), q/k/v and o biases where attention_bias says, and head_dim from the config."""

from engine.models.layers import RMSNorm
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, backend, quantization=None, layer=0):
        super().__init__(config, backend, quantization, layer, o_proj_bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_qk(self, q, k):
        # One row a head: the norms (and their CPU kernel) take [rows, head_dim].
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return q, k


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
