"""Picks the attention backend once at start-up, by name."""

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

_BACKENDS = {"torch": TorchAttentionBackend}


def get_attn_backend(name: str, block_size: int) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(_BACKENDS)}, got {name!r}.")
    return _BACKENDS[name](block_size)
