"""llmmesh's engine: a plain Python library with vLLM's offline API."""

from engine.config import EngineArgs
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
