"""The sampler service's client by module path, as the KV connectors' factory finds a connector.

The client lives one floor up, beside the wire code its service shares; that package registers it here
(register_remote_sampler), so the engine never names it. Torch-free: registering imports nothing.
"""

import importlib

_remote_sampler: str | None = None


def register_remote_sampler(module_path: str, class_name: str) -> None:
    global _remote_sampler
    _remote_sampler = f"{module_path}:{class_name}"


def remote_sampler_class() -> type:
    """The registered client (a BatchSampler); ValueError when none is."""
    if _remote_sampler is None:
        raise ValueError("sampler_address needs a sampler service client: import mesh (llmmesh's wire clients) first.")
    module_path, name = _remote_sampler.split(":")
    return getattr(importlib.import_module(module_path), name)
