"""Text in and out: the tokenizer wrapper, the incremental detokenizer and stop strings."""

from engine.text.detokenizer import RequestDetokenizer
from engine.text.tokenizer import Tokenizer

__all__ = ["RequestDetokenizer", "Tokenizer"]
