"""llmmesh's engine: a plain Python library with vLLM's offline API.

The exports load on first use, so `import engine.text` (the text services) never imports torch.
Configuring logging is left to the application, as for any library.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.request",
    "StructuredOutputsParams": "engine.request",
    "EngineArgs": "engine.config",
    "LoRARequest": "engine.lora.request",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
