"""Weight loading shared by the families: Hugging Face–named tensors into a model whose projections may be fused."""

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter


def _cat_rows(shards: list[torch.Tensor]) -> torch.Tensor:
    """Stack fused shards' rows. Quantization scales of different group sizes (GGUF's Q4_K beside Q6_K) are
    repeated to the finest first, which keeps every weight's value."""
    width = max(s.shape[-1] for s in shards) if shards[0].dim() == 2 else None
    return torch.cat([s.repeat_interleave(width // s.shape[-1], dim=-1) if width else s for s in shards], dim=0)


def load_fused_weights(
    model: nn.Module, weights, fused: dict[str, tuple[str, int]], tie_word_embeddings: bool, load_other=None
) -> None:
    """Copy Hugging Face–named tensors into model, fusing the checkpoint's separate projections as they arrive;
    fused maps a checkpoint projection's name to (its fused layer's name, its part there). Each layer keeps its
    rank's part of a full tensor (a fused layer, of each part). load_other(name, tensor), where given, places the
    tensors it knows itself (a mixture of experts' per-expert weights) and returns the parameters that are then
    complete, or None for a tensor that is not its."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    num_parts = {}
    for fused_name, _ in fused.values():
        num_parts[fused_name] = num_parts.get(fused_name, 0) + 1

    def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
        module = modules.get(name.rpartition(".")[0])
        return module.shard(tensor, name) if hasattr(module, "shard") else tensor

    shards: dict[str, dict[int, torch.Tensor]] = {}
    loaded = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        done = load_other(name, tensor) if load_other is not None else None
        if done is not None:
            loaded.update(done)
            continue
        parts = name.split(".")
        target = fused.get(parts[-2]) if len(parts) >= 2 else None
        if target is not None:
            fused_name = ".".join(parts[:-2] + [target[0], parts[-1]])
            group = shards.setdefault(fused_name, {})
            group[target[1]] = shard(fused_name, tensor)
            if len(group) == num_parts[target[0]]:
                _copy(params, fused_name, _cat_rows([group[i] for i in sorted(group)]))
                loaded.add(fused_name)
                del shards[fused_name]
            continue
        _copy(params, name, shard(name, tensor))
        loaded.add(name)
    # A GGUF layer has parameters for both of the forms a tensor may arrive in; its method checks one came.
    optional = {n for n, p in params.items() if isinstance(p, UninitializedParameter)}
    missing = set(params) - loaded - optional - ({"lm_head.weight"} if tie_word_embeddings else set())
    if missing or shards:
        raise ValueError(f"Checkpoint is missing weights: {sorted(missing | set(shards))[:8]}")


def _copy(params, name, tensor):
    if name not in params:
        raise ValueError(f"Checkpoint has an unexpected weight {name!r}")
    param = params[name]
    if isinstance(param, UninitializedParameter):  # its shape and dtype are the checkpoint's
        param.materialize(tensor.shape, dtype=tensor.dtype)
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
