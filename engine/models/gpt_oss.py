"""gpt-oss (GptOssForCausalLM): a Llama-shaped decoder whose layers alternate sliding-window and full attention
(layer_types), with biases on q/k/v and o_proj, YaRN rope, attention sinks (a learned logit a head that joins the
softmax's denominator and attends to no value: the "sinks" feature of the attention backends), and a mixture of
experts as every MLP.

The router is a biased linear layer; transformers takes each token's top-k logits and a softmax over those k, which
is the softmax over all experts renormalised over the chosen ones (FusedMoE's renormalize, as vLLM runs it). The
experts have biases and gpt-oss's clamped SwiGLU (swigluoai_and_mul, with swiglu_alpha and swiglu_limit).

The checkpoint stores the experts stacked and transposed, gate_up_proj [E, H, 2I] with gate and up interleaved
along the last dimension and down_proj [E, I, H]; they are turned into FusedMoE's layout as they load. Checkpoints
with MXFP4 experts (quantization_config.quant_method "mxfp4", the released ones) are refused at start-up by the
quantization check (engine/models/quantization.py): they are not dequantized here.
"""

from functools import partial

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.distributed.parallel_state import get_tp_rank
from engine.models.config import ModelArchConfig
from engine.models.fused_moe import FusedMoE, expert_weight_loader, swigluoai_and_mul
from engine.models.linear import Linear
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.models.utils import load_fused_weights


class GptOssAttention(LlamaAttention):
    def __init__(
        self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None, layer: int = 0
    ):
        super().__init__(config, backend, quantization, layer, o_proj_bias=config.attention_bias)
        # This rank's heads' sinks (the checkpoint's self_attn.sinks, placed by load_weights).
        self.attn.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)


class GptOssMoE(nn.Module):
    """The router (hidden -> a logit an expert, with a bias, replicated on every rank) and the experts."""

    def __init__(self, config: ModelArchConfig, quantization: str | None = None):
        super().__init__()
        hf = config.hf_config
        num_experts = hf["num_local_experts"]
        self.router = Linear(config.hidden_size, num_experts, bias=True)
        act_fn = partial(swigluoai_and_mul, alpha=float(hf["swiglu_alpha"]), limit=float(hf["swiglu_limit"]))
        self.experts = FusedMoE(
            num_experts,
            hf["num_experts_per_tok"],
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            quantization=quantization,
            act_fn=act_fn,
            has_bias=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config: ModelArchConfig, quantization: str | None, layer: int) -> nn.Module:
        return GptOssMoE(config, quantization)


def _to_fused_moe_layout(weights):
    """The checkpoint's expert tensors in FusedMoE's stacked layout: [E, 2I, H] gate rows first, [E, H, I]."""
    for name, tensor in weights:
        if name.endswith(".experts.gate_up_proj"):
            tensor = tensor.transpose(1, 2)
            tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        elif name.endswith(".experts.gate_up_proj_bias"):
            tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        elif name.endswith(".experts.down_proj"):
            tensor = tensor.transpose(1, 2)
        yield name, tensor


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer

    def load_weights(self, weights) -> None:
        experts = expert_weight_loader(self, {})
        params = dict(self.named_parameters())

        def load_other(name: str, tensor: torch.Tensor) -> list[str] | None:
            if not name.endswith(".self_attn.sinks"):
                return experts(name, tensor)
            # This rank's heads' sinks (tensor parallelism splits the heads).
            param = params[name.replace(".sinks", ".attn.sinks")]
            with torch.no_grad():
                param.copy_(tensor.narrow(0, get_tp_rank() * param.numel(), param.numel()))
            return [name.replace(".sinks", ".attn.sinks")]

        load_fused_weights(
            self, _to_fused_moe_layout(weights), self._FUSED, self.config.tie_word_embeddings, load_other
        )
