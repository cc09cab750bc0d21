"""gpt-oss (GptOssForCausalLM): a Llama-shaped decoder whose layers alternate sliding-window and full attention
(layer_types), with biases on q/k/v and o_proj, YaRN rope, attention sinks (a learned logit a head that joins the
softmax's denominator and attends to no value: the "sinks" feature of the attention backends), and a mixture of
experts as every MLP.

The router is a biased linear layer; transformers takes each token's top-k logits and a softmax over those k, which
is the softmax over all experts renormalised over the chosen ones (FusedMoE's renormalize, as vLLM runs it). The
experts have biases and gpt-oss's clamped SwiGLU (swigluoai_and_mul, with swiglu_alpha and swiglu_limit).

The checkpoint stores the experts stacked and transposed, gate_up_proj [E, H, 2I] with gate and up interleaved
along the last dimension and down_proj [E, I, H]; they are turned into FusedMoE's layout as they load.

The released checkpoints store the experts in MXFP4 (quantization_config.quant_method "mxfp4"): gate_up_proj_blocks
and _scales for [E, 2I, H] and down_proj's for [E, H, I], rows of the transposed matrices. They are dequantized
here as they load, one expert at a time, into the float layout above; the model then runs in --dtype (or with
--quantization int8/int4). No kernel here reads the 4-bit codes themselves, and the dequantized experts take
16 / 4.25 = 3.8 times the checkpoint's bytes in bfloat16: correct on any machine with the memory, not compact.
"""

from functools import partial

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.distributed.parallel_state import get_tp_rank
from engine.models.config import ModelArchConfig, ModelLoadError
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
            # A GGUF file's experts arrive as float (its MXFP4 blocks dequantized as it converts).
            quantization=None if quantization == "gguf" else quantization,
            act_fn=act_fn,
            has_bias=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config: ModelArchConfig, quantization: str | None, layer: int) -> nn.Module:
        return GptOssMoE(config, quantization)


# MXFP4 (the OCP microscaling format): each 4-bit code is an e2m1 float, the low nibble first; each block of 32
# shares an e8m0 scale, a power of two stored with a bias of 127.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, rows, G, 16] uint8 codes and [E, rows, G] uint8 scales -> [E, rows, G * 32] float32, an expert at a
    time so that the temporaries stay one expert's size."""
    table = torch.tensor(_E2M1)
    experts = []
    for codes, scale in zip(blocks, scales):
        nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()
        experts.append(torch.ldexp(table[nibbles], scale.int().sub(127).unsqueeze(-1)).flatten(-2))
    return torch.stack(experts)


def _dequantized_experts(weights):
    """The stream with each MXFP4 pair (name_blocks, name_scales) replaced by the float tensor an unquantized
    checkpoint holds under name: the transposed [E, in, out]."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales") or not base.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            yield name, tensor
            continue
        pair = pending.setdefault(base, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[base]
            yield base, dequantize_mxfp4(pair["blocks"], pair["scales"]).transpose(1, 2)
    if pending:
        raise ModelLoadError(f"MXFP4 experts without their blocks or scales: {', '.join(sorted(pending))}")


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
            self,
            _to_fused_moe_layout(_dequantized_experts(weights)),
            self._FUSED,
            self.config.tie_word_embeddings,
            load_other,
        )
