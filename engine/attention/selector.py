"""Picks the attention backend once at start-up, by name; "auto" picks the fastest for the device."""

import logging

from engine.attention import BACKEND_NAMES
from engine.attention.backend import AttentionBackend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend

logger = logging.getLogger("llmmesh.engine")

_BACKENDS = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend, "cpu": CpuAttentionBackend}
assert set(BACKEND_NAMES) == {"auto", *_BACKENDS}
_AUTO = {"cuda": "triton", "cpu": "cpu"}  # the fastest backend per device type


def resolve_backend_name(name: str, device_type: str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}.")
    return _AUTO.get(device_type, "torch") if name == "auto" else name


def get_attn_backend(
    name: str, block_size: int, device_type: str, needs: frozenset[str] = frozenset()
) -> AttentionBackend:
    """The backend `name` names, which must implement what the model needs (AttentionBackend.features)."""
    resolved = resolve_backend_name(name, device_type)
    if name == "auto" and not needs <= _BACKENDS[resolved].features and needs <= TorchAttentionBackend.features:
        # The reference backend implements every feature first; the kernels may follow.
        logger.info("The %s attention backend does not implement %s; using the torch backend", resolved, sorted(needs))
        resolved = "torch"
    missing = needs - _BACKENDS[resolved].features
    if missing:
        able = [n for n, cls in _BACKENDS.items() if needs <= cls.features]
        raise ValueError(
            f"--attention-backend {name} does not implement {', '.join(sorted(missing))}, which this model's "
            f"layers use; backends that do: {', '.join(able) or 'none'}"
        )
    try:
        return _BACKENDS[resolved](block_size)
    except Exception as e:
        if name != "auto":
            raise
        # "auto" must start anywhere: a kernel that cannot be built here (no compiler) falls back to the reference.
        logger.warning("The %s attention backend is unavailable here (%s); using the torch backend", resolved, e)
        return TorchAttentionBackend(block_size)
