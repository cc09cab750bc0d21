"""The worker's adapters (vLLM's LRUCacheWorkerLoRAManager over a LoRAModelManager).

Adapters the engine has loaded wait in host memory, in an LRU of at most max_cpu_loras (one evicted from it is read
again from its directory when next needed). A step's adapters must be in device slots: max_loras slots of
max_lora_rank per wrapped layer, allocated once; an adapter not in one is copied into a free slot, or into the
least recently used slot no adapter of this step needs. The scheduler never schedules more adapters than slots.
"""

from collections import OrderedDict

import numpy as np
import torch

from engine.lora.layers import LinearWithLoRA, LoRAMapping
from engine.lora.peft import LoRAModel, load_peft_adapter
from engine.lora.request import LoRARequest
from engine.models.config import ModelArchConfig
from kernels.lora import lora_kernel_meta

# The model's packed layers and the PEFT modules they hold, in output order: (attribute path, modules).
_WRAPPED = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)


class LoRAModelManager:
    def __init__(
        self, model, cfg: ModelArchConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int, lora_dtype: str
    ):
        self.cfg = cfg
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        # Each slot's adapter rank (0: empty), read by the CPU kernel so that it skips the slots' padding.
        self.mapping = LoRAMapping(slot_ranks=torch.zeros(max_loras, dtype=torch.int64))
        # Slots in --lora-dtype (auto: the model's); every kernel widens them to float32 as it reads them. A step
        # reads each active adapter's A and B once a layer, so bfloat16 halves those bytes against float32.
        device = model.norm.weight.device
        dtype = model.norm.weight.dtype if lora_dtype == "auto" else getattr(torch, lora_dtype)
        self.device = device
        self.layers: list[dict[str, LinearWithLoRA]] = []  # per decoder layer: attribute path -> wrapper
        for layer in model.layers:
            wrapped = {}
            for path, modules in _WRAPPED:
                parent_name, name = path.split(".")
                parent = getattr(layer, parent_name)
                if not hasattr(parent, name):  # a mixture-of-experts layer: no dense MLP (add_adapter refuses one)
                    continue
                wrapper = LinearWithLoRA(
                    getattr(parent, name),
                    modules,
                    max_loras,
                    max_lora_rank,
                    self.mapping,
                    dtype,
                    device,
                )
                setattr(parent, name, wrapper)
                wrapped[path] = wrapper
            self.layers.append(wrapped)
        self.registered: dict[int, LoRARequest] = {}  # every adapter added, to read again after an eviction
        self.cpu_loras: OrderedDict[int, LoRAModel] = OrderedDict()  # LRU, most recent last
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapters in slots, LRU, most recent last
        self.num_slot_loads = 0  # adapters copied into a slot, ever (the slots' churn)

    # ---- adapters in host memory -----------------------------------------------------------------

    def add_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check an adapter, and keep it in host memory (a ValueError says what is wrong with it)."""
        lora = load_peft_adapter(lora_request, self.cfg, self.max_lora_rank)
        for layer, module in lora.weights:
            if not any(module in wrapper.modules_ for wrapper in self.layers[layer].values()):
                raise ValueError(
                    f"LoRA adapter {lora_request.lora_name!r}: layer {layer}'s {module} is a mixture-of-experts "
                    "layer's, and LoRA on experts is not supported; target the attention projections"
                )
        self.registered[lora_request.lora_int_id] = lora_request
        self._cache(lora)
        return lora

    def remove_adapter(self, lora_int_id: int) -> None:
        self.registered.pop(lora_int_id, None)
        self.cpu_loras.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.mapping.slot_ranks[slot] = 0

    def _cache(self, lora: LoRAModel) -> None:
        self.cpu_loras[lora.lora_request.lora_int_id] = lora
        while len(self.cpu_loras) > self.max_cpu_loras:
            self.cpu_loras.popitem(last=False)

    def _get(self, lora_int_id: int) -> LoRAModel:
        lora = self.cpu_loras.get(lora_int_id)
        if lora is None:  # evicted from host memory: read it again
            lora = load_peft_adapter(self.registered[lora_int_id], self.cfg, self.max_lora_rank)
            self._cache(lora)
        self.cpu_loras.move_to_end(lora_int_id)
        return lora

    # ---- slots ----------------------------------------------------------------------------------

    def activate(self, lora_int_ids: set[int]) -> tuple[dict[int, int], dict[int, ValueError]]:
        """Put these adapters (at most max_loras) in slots: adapter id -> slot, and adapter id -> why it cannot be
        (evicted from host memory, its directory no longer reads): only that adapter's requests fail."""
        assert len(lora_int_ids) <= self.max_loras, "the scheduler let more adapters than slots into one step"
        failures = {}
        for lora_int_id in lora_int_ids:
            if lora_int_id in self.slot_of:
                self.slot_of.move_to_end(lora_int_id)
                continue
            try:
                lora = self._get(lora_int_id)
            except ValueError as e:
                failures[lora_int_id] = e
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used slot whose adapter this step does not need
                victim = next(i for i in self.slot_of if i not in lora_int_ids)
                slot = self.slot_of.pop(victim)
            for layer_index, wrapped in enumerate(self.layers):
                for wrapper in wrapped.values():
                    weights = {
                        m: lora.weights[layer_index, m] for m in wrapper.modules_ if (layer_index, m) in lora.weights
                    }
                    wrapper.set_slot(slot, lora.rank, weights)
            self.slot_of[lora_int_id] = slot
            self.mapping.slot_ranks[slot] = lora.rank
            self.num_slot_loads += 1
        return {i: self.slot_of[i] for i in lora_int_ids if i not in failures}, failures

    def set_mapping(self, token_lora_indices: torch.Tensor, host_indices: np.ndarray) -> None:
        """The step's per-token slots (on the device, and the host array they came from)."""
        self.mapping.token_lora_indices = token_lora_indices
        self.mapping.active = bool((host_indices >= 0).any())
        if self.device.type == "cpu" and self.mapping.active:
            self.mapping.kernel_meta = lora_kernel_meta(torch.from_numpy(host_indices))
