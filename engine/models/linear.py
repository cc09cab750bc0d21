"""The model's weight-bearing layers. Each delegates its weight format to a quantization method
(engine/models/quantization.py): the layer knows its sizes, the method what the weight is and how to use it."""

import torch
from torch import nn

from engine.models.quantization import (
    QuantizeMethodBase,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.quant_method: QuantizeMethodBase = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, quant_method=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.quant_method: QuantizeMethodBase = quant_method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(self, num_embeddings, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, ids)


def tie_weights(lm_head: Linear, embedding: VocabEmbedding) -> None:
    """The output projection reads the embedding's parameters (whatever its method made of them)."""
    for name, param in embedding.named_parameters(recurse=False):
        setattr(lm_head, name, param)


def process_weights_after_loading(model: nn.Module, dtype: torch.dtype) -> None:
    """Every layer's method turns its loaded weights into its kernel's form in `dtype`; then the rest (norms,
    biases) is cast."""
    for module in model.modules():
        if isinstance(module, (Linear, VocabEmbedding)):
            module.quant_method.process_weights_after_loading(module, dtype)
    model.to(dtype)
