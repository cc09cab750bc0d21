"""Picks the attention backend once at start-up, by name; "auto" picks the fastest for the device."""

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

_BACKENDS = {"torch": TorchAttentionBackend}
BACKEND_NAMES = ("auto", *_BACKENDS)


def resolve_backend_name(name: str, device_type: str) -> str:
    """The backend "auto" means on this device: triton on CUDA, torch elsewhere."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {sorted(BACKEND_NAMES)}, got {name!r}.")
    if name != "auto":
        return name
    return "triton" if device_type == "cuda" and "triton" in _BACKENDS else "torch"


def get_attn_backend(name: str, block_size: int, device_type: str) -> AttentionBackend:
    return _BACKENDS[resolve_backend_name(name, device_type)](block_size)
