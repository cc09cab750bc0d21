"""StructuredOutputRequest: one request's grammar, compiling (a Future) and then matching (vLLM's name)."""

from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

    from engine.request import StructuredOutputsParams


class StructuredOutputRequest:
    def __init__(self, params: "StructuredOutputsParams"):
        self.params = params
        # The compile in flight, resolving to the request's GrammarMatcher (StructuredOutputManager.grammar_init).
        self.grammar: Future | None = None

    def is_grammar_ready(self) -> bool:
        """Compiled, or failed to compile (matcher then raises why)."""
        return self.grammar is not None and self.grammar.done()

    @property
    def matcher(self) -> "xgrammar.GrammarMatcher":
        """The matcher, advanced over every output token so far; raises what the compile raised."""
        return self.grammar.result()
