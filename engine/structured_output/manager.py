"""StructuredOutputManager: compiles each structured request's grammar off the step loop, and fills the step's
token bitmask (vLLM's StructuredOutputManager over its xgrammar backend).

Admission checks a constraint with xgrammar's parser alone (validate: no tokenizer, milliseconds). The engine then
compiles it on a thread pool (grammar_init), through one xgrammar GrammarCompiler whose cache is keyed by the
constraint, so a schema seen before compiles in microseconds; the request waits in WAITING_FOR_FSM meanwhile and
the other requests keep stepping. Each step the scheduler asks for one bitmask row per structured request that
samples (grammar_bitmask); the sampler masks its logits with it, and the scheduler advances the request's matcher
over the token it kept.
"""

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.request import Request, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's errors start with a timestamp and its source file: "[06:22:41] /project/cpp/x.cc:83: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def choice_as_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are the choices (JSON's string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def grammar_error(error: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(error).strip())


class StructuredOutputManager:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        # Compiling is CPU work: half the cores, as vLLM sizes this pool.
        self.executor = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() + 1) // 2), thread_name_prefix="grammar")
        # xgrammar (a second's import, transformers with it) is imported by the first constraint, not by every engine.
        self._compiler: xgr.GrammarCompiler | None = None  # made by the first compile (it needs the tokenizer)
        self._compiler_lock = threading.Lock()
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None  # made by the first bitmask

    # ---- admission ---------------------------------------------------------------------------------

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Parse the constraint as xgrammar will compile it; ValueError naming the field if it cannot."""
        import xgrammar as xgr

        kind = params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(params.json, any_whitespace=not params.disable_any_whitespace)
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_as_grammar(params.choice))
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(params.structural_tag)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError for a bad grammar
            raise ValueError(f"structured_outputs.{kind} does not compile: {grammar_error(e)}") from None

    # ---- compiling ---------------------------------------------------------------------------------

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits in WAITING_FOR_FSM until the matcher is ready."""
        request.structured_output_request.grammar = self.executor.submit(
            self._compile, request.structured_output_request.params, list(request.output_token_ids)
        )

    def get_compiler(self) -> "xgr.GrammarCompiler":
        """The engine's one compiler, made on first use from the model's tokenizer (its cache is shared)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from engine.models.files import load_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(
                    load_tokenizer(self.model_dir), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar":
        """The compiled grammar, from the compiler's cache when this constraint was compiled before."""
        compiler, kind = self.get_compiler(), params.kind
        any_whitespace = not params.disable_any_whitespace
        if kind == "json":
            return compiler.compile_json_schema(params.json, any_whitespace=any_whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_as_grammar(params.choice))
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_structural_tag(params.structural_tag)

    def _compile(self, params: StructuredOutputsParams, output_token_ids: list[int]) -> "xgr.GrammarMatcher":
        """The matcher, advanced over a resumed request's output so far (the state it had on its first engine)."""
        import xgrammar as xgr

        try:
            matcher = xgr.GrammarMatcher(self.compile(params))
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {grammar_error(e)}") from None
        for i, token in enumerate(output_token_ids):
            if not matcher.accept_token(token):
                raise ValueError(
                    f"output_token_ids[{i}]: token {token} does not follow structured_outputs.{params.kind}"
                )
        return matcher

    # ---- each step ---------------------------------------------------------------------------------

    def grammar_bitmask(self, requests: list[Request], spec_tokens: dict[str, list[int]] | None = None) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 on the host: the tokens each request's grammar allows next (bit set =
        allowed), one row per request, or with drafts (spec_tokens: request_id -> its drafts) one per verified
        position, consecutive: the matcher advances through the drafts to fill them, then rolls back."""
        import xgrammar as xgr

        spec_tokens = spec_tokens or {}
        counts = [1 + len(spec_tokens.get(r.request_id, ())) for r in requests]
        bitmask = xgr.allocate_token_bitmask(sum(counts), self.vocab_size)
        if sum(counts) == len(requests):
            matchers = [r.structured_output_request.matcher for r in requests]
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            return bitmask
        row = 0
        for request, n in zip(requests, counts):
            matcher = request.structured_output_request.matcher
            accepted = 0
            for token in [*spec_tokens.get(request.request_id, ()), None]:
                if matcher.is_terminated():  # the rows after a stop are never reached: they stay all allowed
                    break
                matcher.fill_next_token_bitmask(bitmask, row + accepted)
                if token is None or not matcher.accept_token(token):
                    break
                accepted += 1
            matcher.rollback(accepted)
            row += n
        return bitmask

    @staticmethod
    def validate_tokens(request: Request, tokens: list[int]) -> list[int]:
        """The longest prefix of tokens the request's grammar accepts after its output so far (its matcher is left
        as it was): proposals the grammar rejects are cut there."""
        matcher = request.structured_output_request.matcher
        accepted = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            accepted += 1
        matcher.rollback(accepted)
        return tokens[:accepted]

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
