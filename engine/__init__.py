"""llmmesh's engine: a plain Python library with vLLM's offline API."""

import logging

# Start-up facts (KV cache size, conversions) are shown by default, as vLLM does.
_logger = logging.getLogger("llmmesh")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)

from engine.config import EngineArgs
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
