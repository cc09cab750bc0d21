"""DeepSeek-V2 (DeepseekV2ForCausalLM): Llama's decoder shape with multi-head latent attention and, from layer
first_k_dense_replace on, a mixture of routed experts beside shared ones.

Attention (MLA) as Hugging Face computes it: the query from q_proj, or through the low-rank q_a_proj, its norm and
q_b_proj where q_lora_rank is set; kv_a_proj_with_mqa makes each token's latent (normalised by kv_a_layernorm) and
its rotary key, one of each for all heads, which is all the KV cache keeps (engine/attention/mla.py); kv_b_proj
up-projects the latent to every head's K (nope part) and V. RoPE turns interleaved pairs (DeepSeek's complex form),
on the qk_rope_head_dim part of q and k only, and YaRN's mscale_all_dim scales the softmax by mscale squared.

The experts' router takes the softmax over all experts, keeps the top num_experts_per_tok (group_limited_greedy:
among the topk_group groups of experts with the best expert), scales their weights by routed_scaling_factor without
renormalising, and adds the shared experts' MLP.

Tensor parallelism: the heads (q, kv_b_proj, o_proj) and the experts' width are split; the latent projections are
replicated, so every rank keeps the whole latent cache.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.distributed.parallel_state import get_tp_rank, get_tp_size
from engine.models.config import ModelArchConfig
from engine.models.fused_moe import FusedMoE, expert_weight_loader
from engine.models.layers import MLP, RMSNorm, rotate_half
from engine.models.linear import ColumnParallelLinear, Linear, RowParallelLinear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.qwen2_moe import QWEN_EXPERT_PROJS
from engine.models.utils import load_fused_weights

# transformers builds the latent norms with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: ModelArchConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the rope scaling has one."""
    hf = config.hf_config
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    rope = config.rope_scaling or {}
    if rope.get("mscale_all_dim"):
        mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (x[2i], x[2i + 1]) turned by frequency i, as DeepSeek's complex multiplication does; cos and sin
    [tokens, dim] are the rotate-half tables (each frequency twice), x [tokens, heads, dim]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half RoPE (DeepSeek-V3 with rope_interleave off)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class MLAUpProjection(nn.Module):
    """kv_b_proj: the latent's up-projection to each head's K (nope part) and V, [heads * (qk_nope + v), kv_lora_rank]
    as the checkpoint stores it, this rank's heads' rows. The attention reads W_UK and W_UV from it and never runs it
    as a layer, so it stays a plain weight (not packed for a kernel)."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int):
        super().__init__()
        self.num_heads, self.qk_nope_head_dim = num_heads, qk_nope_head_dim
        size = num_heads * (qk_nope_head_dim + v_head_dim)
        self.weight = nn.Parameter(torch.empty(size, kv_lora_rank), requires_grad=False)
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()

    def shard(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return tensor.chunk(self.tp_size)[self.tp_rank]

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope, kv_lora_rank] and W_UV [heads, v_head_dim, kv_lora_rank]."""
        w = self.weight.view(self.num_heads, -1, self.weight.shape[-1])
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]


class DeepseekV2Attention(nn.Module):
    def __init__(
        self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None, layer: int = 0
    ):
        super().__init__()
        hf = config.hf_config
        self.num_heads = config.num_attention_heads // get_tp_size()
        self.qk_nope_head_dim, self.qk_rope_head_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = hf["v_head_dim"], hf["kv_lora_rank"]
        self.q_lora_rank = hf["q_lora_rank"]
        bias, hidden, heads = config.attention_bias, config.hidden_size, config.num_attention_heads
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [heads * self.qk_head_dim])
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [heads * self.qk_head_dim])
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = MLAUpProjection(self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias)
        self.scale = softmax_scale(config)
        self.backend = backend
        # DeepSeek's checkpoints pair the rotary dims interleaved; V3 may say otherwise (rope_interleave).
        self.rotary = apply_rotary_interleaved if hf.get("rope_interleave", True) else apply_rotary_half

    def forward(self, x, kv_cache, metadata: AttentionMetadata, cos_sin):
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = self.rotary(q_pe, *cos_sin)
        k_pe = self.rotary(k_pe[:, None], *cos_sin)[:, 0]
        w_uk, w_uv = self.kv_b_proj.split()
        out = self.backend.forward_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, metadata, self.scale, w_uk, w_uv)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_head_dim))


def experts_of_best_groups(group_scores: torch.Tensor, topk_groups: int, num_experts: int) -> torch.Tensor:
    """[tokens, experts] True for the experts of each token's topk_groups best-scored groups."""
    groups = torch.topk(group_scores, topk_groups, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    return group_mask[:, :, None].expand(-1, -1, num_experts // group_mask.shape[1]).reshape(-1, num_experts)


def grouped_topk(scores: torch.Tensor, top_k: int, num_groups: int, topk_groups: int):
    """group_limited_greedy: the top_k experts among the topk_groups groups whose best expert scores highest."""
    group_scores = scores.view(scores.shape[0], num_groups, -1).max(dim=-1).values
    expert_mask = experts_of_best_groups(group_scores, topk_groups, scores.shape[-1])
    return torch.topk(scores.masked_fill(~expert_mask, 0.0), top_k, dim=-1, sorted=False)


class DeepseekV2MoE(nn.Module):
    """The routed experts (FusedMoE's stacked weights, routed here by DeepSeek's rule) and the shared experts."""

    def __init__(self, config: ModelArchConfig, quantization: str | None = None):
        super().__init__()
        hf = config.hf_config
        num_experts, self.top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
        self.topk_method, self.num_groups, self.topk_groups = hf.get("topk_method"), hf["n_group"], hf["topk_group"]
        self.routed_scaling_factor = hf["routed_scaling_factor"]
        width = hf["moe_intermediate_size"]
        # A plain layer: the router reads its weight in float32, as transformers keeps it (never a packed kernel's).
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, self.top_k, config.hidden_size, width, False, quantization)
        self.shared_experts = MLP(config.hidden_size, width * hf["n_shared_experts"], quantization)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights: the softmax in float32, as transformers' router computes it."""
        scores = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            weights, ids = grouped_topk(scores, self.top_k, self.num_groups, self.topk_groups)
        else:
            weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return self.experts.forward_experts(x, weights, ids) + self.shared_experts(x)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV2Attention
    moe_cls = DeepseekV2MoE

    def make_mlp(self, config: ModelArchConfig, quantization: str | None, layer: int) -> nn.Module:
        if layer >= config.hf_config["first_k_dense_replace"]:
            return self.moe_cls(config, quantization)
        return super().make_mlp(config, quantization, layer)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = DeepseekV2DecoderLayer
    # Only the MLPs' gate and up are fused: MLA's projections stay the checkpoint's.
    _FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        # A GGUF file's MLPs and experts keep their codes; its attention tensors are dequantized as it converts.
        if quantization not in (None, "gguf"):
            raise ValueError(
                f"--quantization {quantization} is not implemented for {config.architecture}: its attention reads "
                "kv_b_proj's float weight; serve it unquantized"
            )
        super().__init__(config, backend, quantization)

    def load_weights(self, weights) -> None:
        experts = expert_weight_loader(self, QWEN_EXPERT_PROJS)
        load_fused_weights(self, weights, self._FUSED, self.config.tie_word_embeddings, experts)
