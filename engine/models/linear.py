"""The model's weight-bearing layers. Each delegates its weight format to a quantization method
(engine/models/quantization.py): the layer knows its sizes, the method what the weight is and how to use it.

Tensor parallelism (Megatron's split, vLLM's layer names): a ColumnParallelLinear keeps its rank's slice of the
output rows, a RowParallelLinear its slice of the input columns and sums the ranks' partial outputs, and the
vocabulary layers keep their rank's slice of the vocabulary. Whatever parameters the method created (a float
weight, or codes with their scales and zeros) are cut the same way as the checkpoint's full tensors arrive
(shard()), so each rank holds only its part; a quantized tensor whose groups would be cut is refused.
"""

import torch
from torch import nn

from engine.distributed.parallel_state import all_gather, all_reduce, divide, get_tp_rank, get_tp_size
from engine.models.config import ModelArchConfig
from engine.models.quantization import (
    QuantizeMethodBase,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)


def _narrow(tensor: torch.Tensor, dim: int, rank: int, size: int, what: str) -> torch.Tensor:
    """Rank `rank`'s equal part of tensor along dim."""
    if size == 1 or tensor.dim() <= dim or tensor.shape[dim] == 1:  # a per-row scale spans every rank's part
        return tensor
    if tensor.shape[dim] % size:
        raise ValueError(
            f"{what} of shape {tuple(tensor.shape)} does not split into --tensor-parallel-size {size} equal parts "
            f"along dimension {dim} (a quantized weight's groups would be cut); pick a size that divides it"
        )
    part = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * part, part).contiguous()


class Linear(nn.Module):
    """A replicated layer: every rank holds the whole weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None):
        super().__init__()
        # The rank this layer was built for (an engine of one device may share its process with a group's rank 0).
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.quant_method: QuantizeMethodBase = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None

    def shard(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (all of it here)."""
        return tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class ColumnParallelLinear(Linear):
    """The output split across ranks: each computes its slice, with no communication. output_sizes are the
    fused parts (q, k, v or gate, up), each cut on its own so a rank holds its slice of every part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, quant_method=None):
        size = get_tp_size()
        self.output_sizes = [divide(n, size, "a fused layer's part size") for n in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias, quant_method)

    def shard(self, tensor, what):
        return _narrow(tensor, 0, self.tp_rank, self.tp_size, what)


class RowParallelLinear(Linear):
    """The input split across ranks: each multiplies its slice, and the partial outputs are summed (one
    all-reduce). The bias is added once, by rank 0 (process_weights_after_loading drops it elsewhere)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None):
        input_size = divide(input_size, get_tp_size(), "a row-parallel layer's input size")
        super().__init__(input_size, output_size, bias, quant_method)

    def shard(self, tensor, what):
        return _narrow(tensor, 1, self.tp_rank, self.tp_size, what)

    def forward(self, x):
        out = self.quant_method.apply(self, x)
        return all_reduce(out) if self.tp_size > 1 else out


def _vocab_shard(tensor: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    """Rank `rank`'s `rows` rows of a [vocab, ...] tensor, zero-padded past the vocabulary's end."""
    start = rank * rows
    part = tensor[start : start + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    return part.contiguous()


class VocabParallelEmbedding(nn.Module):
    """vLLM's VocabParallelEmbedding: each rank holds ceil(vocab / ranks) rows; a token looks up on the rank that has it, zeros elsewhere, and
    one all-reduce sums them."""

    def __init__(self, num_embeddings: int, embedding_dim: int, quant_method=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.quant_method: QuantizeMethodBase = quant_method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(self, self.rows_per_rank, embedding_dim)

    def shard(self, tensor, what):
        return _vocab_shard(tensor, self.tp_rank, self.rows_per_rank) if self.tp_size > 1 else tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = self.quant_method.apply(self, local.masked_fill(outside, 0))
        return all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(Linear):
    """The output projection over the vocabulary split as VocabParallelEmbedding's; the logits are gathered, so
    every rank ends with all of them."""

    def __init__(self, input_size: int, vocab_size: int, quant_method=None):
        self.vocab_size, self.rows_per_rank = vocab_size, -(-vocab_size // get_tp_size())
        super().__init__(input_size, self.rows_per_rank, False, quant_method)

    def shard(self, tensor, what):
        return _vocab_shard(tensor, self.tp_rank, self.rows_per_rank) if self.tp_size > 1 else tensor

    def forward(self, x):
        logits = self.quant_method.apply(self, x)
        return all_gather(logits)[..., : self.vocab_size] if self.tp_size > 1 else logits


def tie_weights(lm_head: Linear, embedding: VocabParallelEmbedding) -> None:
    """The output projection reads the embedding's parameters (whatever its method made of them)."""
    for name, param in embedding.named_parameters(recurse=False):
        setattr(lm_head, name, param)


def process_weights_after_loading(model: nn.Module, dtype: torch.dtype, batch_invariant: bool = True) -> None:
    """Every layer's method turns its loaded weights into its kernel's form in `dtype` (batch_invariant: one kernel
    for every row count, engine/models/quantization.py); then the rest (norms, biases) is cast."""
    for module in model.modules():
        if isinstance(module, (Linear, VocabParallelEmbedding)):
            module.batch_invariant = batch_invariant
            module.quant_method.process_weights_after_loading(module, dtype)
        if isinstance(module, RowParallelLinear) and module.tp_rank > 0:
            module.bias = None
    model.to(dtype)


# Where each mixture-of-experts family's config gives its routed expert count (DeepSeek's, Mixtral's, Qwen's).
NUM_EXPERTS_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")


def check_tensor_parallel_size(config: ModelArchConfig, size: int, enable_expert_parallel: bool = False) -> None:
    """A start-up error unless the heads, KV heads and MLP widths split evenly over `size` ranks. With expert
    parallelism each rank keeps whole experts, so the experts' width need not divide; the dense MLPs' (a dense
    layer's, the shared experts') still must."""
    divide(config.num_attention_heads, size, "the model's attention heads (num_attention_heads)")
    divide(config.num_key_value_heads, size, "the model's KV heads (num_key_value_heads)")
    hf = config.hf_config
    has_experts = any(hf.get(f) for f in NUM_EXPERTS_FIELDS)
    moe_width = hf.get("moe_intermediate_size")
    # Mixtral's and gpt-oss's intermediate_size is their experts' width; beside moe_intermediate_size, a dense one's.
    if not has_experts or moe_width:
        divide(config.intermediate_size, size, "the model's MLP width (intermediate_size)")
    if hf.get("shared_expert_intermediate_size"):
        divide(
            hf["shared_expert_intermediate_size"], size, "the shared expert's width (shared_expert_intermediate_size)"
        )
    if moe_width and hf.get("n_shared_experts"):
        width = moe_width * hf["n_shared_experts"]
        divide(width, size, "the shared experts' width (moe_intermediate_size x n_shared_experts)")
    if has_experts and not enable_expert_parallel:
        width, field = (
            (moe_width, "moe_intermediate_size") if moe_width else (config.intermediate_size, "intermediate_size")
        )
        divide(width, size, f"the experts' width ({field}; --enable-expert-parallel keeps experts whole)")
