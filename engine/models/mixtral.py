"""Mixtral (MixtralForCausalLM): Mistral's decoder (its sliding window on every layer where the config sets one) with
each MLP replaced by a sparse mixture of experts, block_sparse_moe: a router picks num_experts_per_tok of
num_local_experts SiLU-gated experts a token, their softmax weights renormalised over the chosen ones
(engine/models/fused_moe.py)."""

from engine.models.config import ModelArchConfig
from engine.models.fused_moe import SparseMoeBlock, expert_weight_loader
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.utils import load_fused_weights


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelArchConfig, quantization: str | None, layer: int):
        hf = config.hf_config
        return SparseMoeBlock(
            config.hidden_size,
            hf["num_local_experts"],
            hf["num_experts_per_tok"],
            config.intermediate_size,
            renormalize=True,
            quantization=quantization,
        )


def _rename(name: str) -> str:
    """The checkpoint's block_sparse_moe is the decoder layer's mlp here."""
    return name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer

    def load_weights(self, weights) -> None:
        experts = expert_weight_loader(self, {"w1": "w1", "w3": "w3", "w2": "w2"})
        renamed = ((_rename(name), tensor) for name, tensor in weights)
        load_fused_weights(self, renamed, self._FUSED, self.config.tie_word_embeddings, experts)
