"""Shared by the families: weight loading (Hugging Face–named tensors into a model whose projections may be
fused), and the split of the decoder layers into pipeline stages (vLLM's get_pp_indices and make_layers)."""

import itertools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from engine.distributed.parallel_state import get_pp_rank, get_pp_size, is_first_stage, is_last_stage


class PPMissingLayer(nn.Identity):
    """A layer another pipeline stage holds: in its place here so that names and indices stay the checkpoint's,
    with no weights."""


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of stage pp_rank: an even split, the remainder one each to the stages before the
    last (which also computes the final norm and the logits), as vLLM splits them."""
    if num_layers < pp_size:
        raise ValueError(
            f"the model's {num_layers} decoder layers (num_hidden_layers) do not split into "
            f"--pipeline-parallel-size {pp_size} stages; use at most {num_layers} stages"
        )
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def make_layers(num_layers: int, layer_fn: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """This stage's decoder layers, layer_fn(i) each, in a list of all num_layers where the others are
    PPMissingLayer; and its [start, end)."""
    start, end = get_pp_indices(num_layers, get_pp_rank(), get_pp_size())
    layers = [layer_fn(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)]
    return start, end, nn.ModuleList(layers)


def stage_layers(layers: nn.ModuleList, start: int, end: int) -> Iterator[nn.Module]:
    """This stage's layers, in order: slicing the ModuleList would build a new one every forward pass (about 90 µs
    for 30 layers)."""
    return itertools.islice(layers, start, end)


def first_stage_only(make: Callable[[], nn.Module]) -> nn.Module:
    """make() on the first pipeline stage (the embedding); a PPMissingLayer elsewhere."""
    return make() if is_first_stage() else PPMissingLayer()


def last_stage_only(make: Callable[[], nn.Module]) -> nn.Module:
    """make() on the last pipeline stage (the final norm, the LM head); a PPMissingLayer elsewhere."""
    return make() if is_last_stage() else PPMissingLayer()


def is_pp_missing(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether a checkpoint tensor belongs to a layer another pipeline stage holds."""
    parts = name.split(".")
    return any(isinstance(modules.get(".".join(parts[:i])), PPMissingLayer) for i in range(1, len(parts)))


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
    # A last pipeline stage without the embedding takes its tied LM head from the embedding's tensor (a quantized
    # one has its own codes in the checkpoint).
    embedding_to_head = (
        tie_word_embeddings and isinstance(modules.get("embed_tokens"), PPMissingLayer) and "lm_head.weight" in params
    )
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        if name == "embed_tokens.weight" and embedding_to_head:
            name = "lm_head.weight"
        if is_pp_missing(name, modules):
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
