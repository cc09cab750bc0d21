"""Processor: admission, the one place a request is checked and completed before the engine sees it (vLLM's
Processor).

It checks a request against the configured limits (RequestLimits) and the model (vocabulary, length, KV cache
size, --max-logprobs), refuses what can never work (a grammar that does not compile too), tokenizes bad words,
truncates the prompt, resolves a request's LoRA adapter in the engine's LoRARegistry, and builds the engine
Requests, complete (the n children of one request, its EOS ids, priority, cache salt, adapter, trace context and KV
transfer parameters): nothing changes them after. The offline LLM and AsyncLLM (both engine protocols) admit
through it, and the gateway checks through it: the gateway has no tokenizer or grammar compiler in process and knows
the model from the engines' ModelInfo, so it checks everything but the bad words' tokens and the grammars, which
the engine checks. Every refusal is a ValueError naming the field and what it allows.
"""

import time
from dataclasses import replace

from engine.limits import RequestLimits
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest
from engine.pooling.config import PoolerConfig
from engine.pooling.params import PoolingParams
from engine.request import Request, SamplingParams


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: keep the end of the prompt, as vLLM does (-1: as much as the model takes)."""
    if keep is None:
        return prompt_token_ids
    return prompt_token_ids[-(max_model_len if keep == -1 else keep) :]


def fan_out(
    request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float, **fields
) -> list[Request]:
    """The engine requests behind one user request: itself when n == 1, else n children `i_<id>`; fields: the rest
    of each Request (priority, cache salt...).

    vLLM's rule: child i of a seeded request draws with seed + i. Only the first child asks for
    prompt logprobs, so the others can share the prompt's cached blocks.
    """
    if params.n == 1:
        return [Request(request_id, prompt_token_ids, params, arrival_time=arrival_time, **fields)]
    return [
        Request(
            child_request_id(index, request_id),
            prompt_token_ids,
            params.clone(
                n=1,
                seed=None if params.seed is None else params.seed + index,
                prompt_logprobs=params.prompt_logprobs if index == 0 else None,
            ),
            arrival_time=arrival_time,
            **fields,
        )
        for index in range(params.n)
    ]


class Processor:
    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids=(),
        limits: RequestLimits | None = None,
        max_logprobs: int | None = None,
        kv_capacity_tokens: int | None = None,
        tokenizer=None,
        structured_output_manager=None,
        lora_registry: LoRARegistry | None = None,
        pooler_config: PoolerConfig | None = None,
        mm_info=None,
        mm_limits=None,
    ):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.limits = limits  # None: the offline LLM, whose caller is trusted with sizes
        self.max_logprobs = max_logprobs  # None: not checked here (the gateway leaves it to the engine)
        self.kv_capacity_tokens = kv_capacity_tokens
        self.tokenizer = tokenizer  # engine.text.Tokenizer; None: bad words are tokenized further in
        # Parses grammars (xgrammar); None: they are checked further in (the gateway imports no xgrammar).
        self.structured_output_manager = structured_output_manager
        # The engine's loaded adapters (EngineCore.lora_registry, kept current); None: LoRA is off.
        self.lora_registry = LoRARegistry(enable_lora=False) if lora_registry is None else lora_registry
        # A pooling engine's (--runner pooling): it takes PoolingParams requests only; None: SamplingParams only.
        self.pooler_config = pooler_config
        # A vision-language model's image info and the engine's multi-modal limits (engine.multimodal.processing);
        # None for a text-only model, which refuses images.
        self.mm_info = mm_info
        self.mm_limits = mm_limits

    @classmethod
    def for_engine(cls, core, limits: RequestLimits | None = None, tokenizer=None) -> "Processor":
        """Admission for one EngineCore: its model, its --max-logprobs and its KV cache."""
        return cls(
            core.model_config.vocab_size,
            core.max_model_len,
            core.model_config.eos_token_ids,
            limits,
            core.config.model_config.max_logprobs,
            core.num_blocks * core.config.cache_config.block_size,
            tokenizer,
            core.structured_output_manager,
            core.lora_registry,
            core.pooler_config,
            core.mm_info,
            core.mm_limits,
        )

    def check_ids(self, request_id: str, cache_salt: str | None) -> None:
        if self.limits is not None:
            self.limits.check_id("request_id", request_id)
            self.limits.check_id("cache_salt", cache_salt or "")

    def process_params(self, params: SamplingParams) -> None:
        """The limits, the model's own bounds, and bad words that could never match; tokenizes the bad words."""
        if self.limits is not None:
            self.limits.check_params(params, self.max_model_len)
        params.verify_for_model(self.vocab_size, -1 if self.max_logprobs is None else self.max_logprobs)
        for i, word in enumerate(params.bad_words):
            # vLLM strips a bad word's leading space and matches it at the start of text or after a space: a word
            # of whitespace alone is no word at all.
            if not word.strip():
                raise ValueError(f"bad_words[{i}] must contain a character other than whitespace, got {word!r}.")
        if params.structured_outputs is not None and self.structured_output_manager is not None:
            self.structured_output_manager.validate(params.structured_outputs)
        if params.bad_words and self.tokenizer is not None:
            params.update_from_tokenizer(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
            self.check_bad_words_token_ids(params)

    def check_bad_words_token_ids(self, params: SamplingParams) -> None:
        for i, word in enumerate(params.bad_words_token_ids):
            if not word:
                raise ValueError(f"bad_words: entry {i} encodes to no token.")
            bad = [t for t in word if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"bad_words: token ids must be in [0, {self.vocab_size}), got {bad[:3]}.")

    def resolve_lora(self, lora_name: str) -> LoRARequest | None:
        """A request's adapter by the name a client gave (None for the base model); LookupError when unknown."""
        return self.lora_registry.resolve(lora_name)

    def process_lora(self, lora_request: LoRARequest | None) -> None:
        """The adapter must be one the engine has loaded, under this name and id."""
        if lora_request is not None:
            self.lora_registry.check(lora_request)

    def process_prompt(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> list[int]:
        """The prompt after truncate_prompt_tokens, if the model and the KV cache can ever run it. A pooling
        request's may fill max_model_len (it generates nothing)."""
        pooling = isinstance(params, PoolingParams)
        keep = None if pooling else params.truncate_prompt_tokens
        ids = truncate_prompt(list(prompt_token_ids), keep, self.max_model_len)
        n, vocab = len(ids), self.vocab_size
        if n == 0:
            raise ValueError("prompt_token_ids: the prompt is empty; it must contain at least one token.")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is out of vocabulary; token ids must be in [0, {vocab})."
            )
        if pooling and n > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: the prompt (length {n}) is longer than the maximum model length of "
                f"{self.max_model_len}."
            )
        if not pooling and n >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: the prompt (length {n}) is longer than the maximum model length of "
                f"{self.max_model_len}; it must be at most {self.max_model_len - 1} tokens so one can be "
                "generated."
            )
        if self.kv_capacity_tokens is not None and n >= self.kv_capacity_tokens:
            raise ValueError(
                f"prompt_token_ids: the prompt (length {n}) can never fit the KV cache, which holds "
                f"{self.kv_capacity_tokens} tokens; raise --kv-cache-memory."
            )
        return ids

    def check_output_token_ids(self, output_token_ids: list[int], num_prompt_tokens: int, params) -> None:
        """A resumed request's output so far: one completion, in the vocabulary, with room for one more token."""
        if params.n != 1:
            raise ValueError(f"output_token_ids: a resumed request has one completion (n=1), got n={params.n}.")
        bad = [t for t in output_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"output_token_ids: token ids must be in [0, {self.vocab_size}), got {bad[:3]}.")
        n = len(output_token_ids)
        if params.max_tokens is not None and n >= params.max_tokens:
            raise ValueError(
                f"output_token_ids: {n} tokens leave none to generate under max_tokens={params.max_tokens}."
            )
        if num_prompt_tokens + n >= self.max_model_len:
            raise ValueError(
                f"output_token_ids: the prompt and output ({num_prompt_tokens + n} tokens) leave none to generate "
                f"under the maximum model length of {self.max_model_len}."
            )

    def process_inputs(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: tuple[tuple[str, str], ...] = (),
        kv_transfer_params: dict | None = None,
        mm_features: list | None = None,
        output_token_ids: list[int] = (),
    ) -> list[Request]:
        """Everything above, in the order a client's mistakes are best reported; the engine requests to run.
        trace_headers: the request span's traceparent/tracestate, for the calls the engine makes for it.
        kv_transfer_params: vLLM's, already checked by the caller, for the KV connector. PoolingParams make one
        pooling request (a pooling engine's only kind), SamplingParams a generating one (n, when n > 1).
        mm_features: the prompt's images (engine.multimodal.inputs.MultiModalFeatureSpec), placeholders expanded in
        prompt_token_ids. output_token_ids: a request resumed from another engine, the tokens it generated there."""
        self.check_ids(request_id, cache_salt)
        self.process_lora(lora_request)
        if isinstance(params, PoolingParams):
            request = self.process_pooling_inputs(
                request_id, prompt_token_ids, params, arrival_time, priority, cache_salt, lora_request, trace_headers
            )
            return [request]
        if self.pooler_config is not None:
            raise ValueError(
                "this engine runs --runner pooling (an embedding model): it embeds prompts and generates nothing; "
                "send an embedding request."
            )
        self.process_params(params)
        if mm_features and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with images: it would cut their placeholders.")
        prompt_token_ids = self.process_prompt(prompt_token_ids, params)
        if mm_features:
            from engine.multimodal.checks import check_mm_features

            check_mm_features(prompt_token_ids, mm_features, self.mm_info, self.mm_limits)
        if output_token_ids:
            self.check_output_token_ids(list(output_token_ids), len(prompt_token_ids), params)
        return fan_out(
            request_id,
            prompt_token_ids,
            params,
            time.monotonic() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt or None,
            lora_request=lora_request,
            trace_headers=trace_headers,
            kv_transfer_params=kv_transfer_params or {},
            mm_features=mm_features,
            output_token_ids=list(output_token_ids),
        )

    def process_pooling_inputs(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
        lora_request: LoRARequest | None,
        trace_headers: tuple[tuple[str, str], ...],
    ) -> Request:
        """One pooling request (process_inputs checked its ids and adapter): the prompt checked, its params told
        whether its pooling reads the prefix cache."""
        if self.pooler_config is None:
            raise ValueError(
                "this engine runs --runner generate: it cannot embed; serve an embedding model with --runner pooling."
            )
        prompt_token_ids = self.process_prompt(prompt_token_ids, params)
        params = replace(params, skip_reading_prefix_cache=self.pooler_config.needs_all_positions)
        return Request(
            request_id,
            prompt_token_ids,
            SamplingParams(max_tokens=1, detokenize=False),  # never sampled: the request ends after its prefill
            self.eos_token_ids,
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            cache_salt or None,
            lora_request,
            trace_headers,
            pooling_params=params,
        )
