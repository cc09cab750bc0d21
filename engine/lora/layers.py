"""LinearWithLoRA: a loaded Linear plus each token's adapter delta (vLLM's BaseLayerWithLoRA).

The wrapper owns its layer's adapter slots (lora_a [slots, R, in], lora_b [slots, R, out], allocated once) and
reads the step's LoRAMapping, which every wrapped layer shares: the base layer runs as before, then one shrink and
one expand add the delta of each token's adapter into its output.
"""

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed.parallel_state import all_reduce
from engine.models.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kernels.lora import lora_cpu_kernel, lora_expand, lora_shrink


@dataclass
class LoRAMapping:
    """One step's adapters: the slot of each token of the flat batch (-1: base model, vLLM's token_lora_indices) on
    the device, each slot's adapter rank (int64, on the host: the CPU kernel reads no padding), whether any token
    has an adapter, and for the CPU kernel the tokens grouped by slot (kernels.lora.lora_kernel_meta), once a step
    for every layer."""

    token_lora_indices: torch.Tensor | None = None
    slot_ranks: torch.Tensor | None = None
    active: bool = False
    kernel_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class LinearWithLoRA(nn.Module):
    def __init__(
        self,
        base: Linear,
        modules: tuple[str, ...],
        max_loras: int,
        max_lora_rank: int,
        mapping: LoRAMapping,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.base = base
        self.modules_ = modules  # the PEFT module names of the slices, in output order (q, k, v)
        # This rank's part of each slice (a column-parallel layer's output is split slice by slice).
        out_sizes = getattr(base, "output_sizes", [base.output_size])
        offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.out_slices = list(zip(offsets, out_sizes))
        # Slice i's rows of A are [i * R, i * R + rank); its B is rows [0, rank) of its own columns (kernels/lora.py).
        self.lora_a = torch.zeros(max_loras, len(modules) * max_lora_rank, base.input_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, max_lora_rank, base.output_size, dtype=dtype, device=device)
        self.mapping = mapping
        self.slice_sizes = list(out_sizes)
        # With tensor parallelism a row-parallel layer's ranks each hold part of the input: A is cut the same way,
        # and each rank's partial delta joins its partial output before the one all-reduce sums them.
        self.reduce = isinstance(base, RowParallelLinear) and base.tp_size > 1
        self.cpu_kernel = lora_cpu_kernel() if device.type == "cpu" else None

    def set_slot(self, slot: int, rank: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's A and B (scaled) for this layer's modules into a slot, this rank's part of them (B by
        output rows in a column-parallel layer, A by input columns in a row-parallel one); modules it lacks stay
        zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, (module, (offset, size)) in enumerate(zip(self.modules_, self.out_slices)):
            if module in weights:
                a, b = weights[module]
                if isinstance(self.base, ColumnParallelLinear):
                    b = self.base.shard(b, f"LoRA B of {module}")
                if isinstance(self.base, RowParallelLinear):
                    a = self.base.shard(a, f"LoRA A of {module}")
                first = i * self.lora_b.shape[1]
                self.lora_a[slot, first : first + rank] = a
                self.lora_b[slot, :rank, offset : offset + size] = b.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.quant_method.apply(self.base, x)  # before a row-parallel layer's all-reduce
        mapping = self.mapping
        if mapping.active:  # any adapter in this step
            if self.cpu_kernel is not None:
                self.cpu_kernel(
                    x, y, self.lora_a, self.lora_b, *mapping.kernel_meta, mapping.slot_ranks, self.slice_sizes
                )
            else:
                indices = mapping.token_lora_indices
                lora_expand(lora_shrink(x, self.lora_a, indices), self.lora_b, indices, y, self.slice_sizes)
        return all_reduce(y) if self.reduce else y
