"""Processor: admission, the one place a request is checked and completed before the engine sees it (vLLM's
Processor).

It checks a request against the configured limits (RequestLimits) and the model (vocabulary, length, KV cache
size, --max-logprobs), refuses what can never work (a grammar that does not compile too), tokenizes bad words,
truncates the prompt, fills in the EOS ids and resolves a request's LoRA adapter among those loaded. The offline LLM, AsyncLLM (both engine protocols) and the gateway
all admit through it; the gateway has no tokenizer or grammar compiler in process and knows the model from the
engines' ModelInfo, so it checks everything but the bad words' tokens and the grammars, which the engine checks. Every refusal is a ValueError naming the field and what it allows.
"""

from engine.limits import RequestLimits
from engine.lora.request import LoRARequest
from engine.output_processor import truncate_prompt
from engine.request import SamplingParams


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
        lora_registry: dict[str, LoRARequest] | None = None,
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
        # The engine's loaded adapters by name (EngineCore.lora_registry, kept current); None: LoRA is off.
        self.lora_registry = lora_registry

    @classmethod
    def for_engine(cls, core, limits: RequestLimits | None = None, tokenizer=None) -> "Processor":
        """Admission for one EngineCore: its model, its --max-logprobs and its KV cache."""
        return cls(
            core.model_config.vocab_size,
            core.max_model_len,
            core.model_config.eos_token_ids,
            limits,
            core.args.max_logprobs,
            core.num_blocks * core.args.block_size,
            tokenizer,
            core.structured_output_manager,
            core.lora_registry if core.args.enable_lora else None,
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

    def process_lora(self, lora_request: LoRARequest | None) -> None:
        """The adapter must be one the engine has loaded, under this name and id."""
        if lora_request is None:
            return
        if self.lora_registry is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters (start it with --enable-lora).")
        loaded = self.lora_registry.get(lora_request.lora_name)
        if loaded is None:
            names = ", ".join(sorted(self.lora_registry)) or "none"
            raise ValueError(
                f"lora_request: unknown LoRA adapter {lora_request.lora_name!r}; loaded adapters: {names}."
            )
        if loaded != lora_request:
            raise ValueError(
                f"lora_request: adapter {lora_request.lora_name!r} is loaded as id {loaded.lora_int_id} from "
                f"{loaded.lora_path}, not as id {lora_request.lora_int_id} from {lora_request.lora_path}."
            )

    def process_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt after truncate_prompt_tokens, if the model and the KV cache can ever run it."""
        ids = truncate_prompt(list(prompt_token_ids), params.truncate_prompt_tokens, self.max_model_len)
        n, vocab = len(ids), self.vocab_size
        if n == 0:
            raise ValueError("prompt_token_ids: the prompt is empty; it must contain at least one token.")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is out of vocabulary; token ids must be in [0, {vocab})."
            )
        if n >= self.max_model_len:
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

    def process_inputs(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[int]:
        """Everything above, in the order a client's mistakes are best reported; the prompt to run."""
        self.check_ids(request_id, cache_salt)
        self.process_lora(lora_request)
        self.process_params(params)
        return self.process_prompt(prompt_token_ids, params)
