"""LinearWithLoRA: a loaded Linear plus each token's adapter delta (vLLM's BaseLayerWithLoRA).

The wrapper owns its layer's adapter slots (lora_a [slots, R, in], lora_b [slots, out, R], allocated once) and
reads the step's LoRAMapping, which every wrapped layer shares: the base layer runs as before, then one shrink and
one expand add the delta of each token's adapter into its output.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.lora import LoRAGroups, lora_expand, lora_groups_cpu, lora_segments_cpu, lora_shrink


@dataclass
class LoRAMapping:
    """One step's adapters: the slot of each token of the flat batch (-1: base model, vLLM's token_lora_mapping) on
    the device, and for the CPU path the same as runs of consecutive tokens, (slot, start, end, rank): the short runs
    (decodes) batched over the slots in `groups`, the others in `segments`. `active`: any adapter in the step."""

    token_lora_indices: torch.Tensor | None = None
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)
    groups: LoRAGroups | None = None
    active: bool = False


class LinearWithLoRA(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        modules: tuple[str, ...],
        out_sizes: tuple[int, ...],
        max_loras: int,
        max_lora_rank: int,
        mapping: LoRAMapping,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.base = base
        self.modules_ = modules  # the PEFT module names of the slices, in output order (q, k, v)
        offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.out_slices = list(zip(offsets, out_sizes))
        # A slice's A rows are [i * rank, (i + 1) * rank) of its adapter's rank; B is block-diagonal to match.
        self.lora_a = torch.zeros(max_loras, len(modules) * max_lora_rank, base.input_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, base.output_size, len(modules) * max_lora_rank, dtype=dtype, device=device)
        self.mapping = mapping

    def set_slot(self, slot: int, rank: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's A and B (scaled) for this layer's modules into a slot; modules it lacks stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, (module, (offset, size)) in enumerate(zip(self.modules_, self.out_slices)):
            if module in weights:
                a, b = weights[module]
                self.lora_a[slot, i * rank : (i + 1) * rank] = a
                self.lora_b[slot, offset : offset + size, i * rank : (i + 1) * rank] = b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = self.mapping
        if not mapping.active:  # no adapter in this step
            return y
        if x.device.type == "cpu":
            if mapping.groups is not None:
                lora_groups_cpu(x, y, self.lora_a, self.lora_b, mapping.groups, len(self.out_slices))
            lora_segments_cpu(x, y, self.lora_a, self.lora_b, mapping.segments, self.out_slices)
        else:
            indices = mapping.token_lora_indices
            lora_expand(lora_shrink(x, self.lora_a, indices), self.lora_b, indices, y)
        return y
