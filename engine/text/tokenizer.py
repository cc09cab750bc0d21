"""The tokenizer wrapper: the one place the engine turns text into token ids and back."""

from pathlib import Path


class Tokenizer:
    """Thin wrapper over a Hugging Face tokenizer: the one place the engine turns text into ids and back."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        # The Rust tokenizer behind a fast tokenizer; the detokenizer streams through it (DecodeStream).
        self.backend = hf_tokenizer.backend_tokenizer if getattr(hf_tokenizer, "is_fast", False) else None
        self.vocab_size = len(hf_tokenizer)  # added tokens included
        self.eos_token_id = hf_tokenizer.eos_token_id
        added = hf_tokenizer.added_tokens_decoder
        # Every id that skip_special_tokens drops. transformers 5 lists only the named special tokens
        # (bos/eos/unk/pad...) in all_special_ids, while decode also drops added tokens marked special.
        self.all_special_ids = set(hf_tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        # Added tokens' text, for spaces_between_special_tokens=False in the detokenizer.
        self.added_token_texts = {i: t.content for i, t in added.items()}
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Tokenizer":
        from engine.models.files import load_tokenizer

        return cls(load_tokenizer(Path(model_dir)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        # transformers 5 ignores spaces_between_special_tokens (it only ever mattered to slow tokenizers in 4.x);
        # it is passed on for the versions that honour it.
        return self.hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    def apply_chat_template(
        self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text for a chat; raises ValueError when the tokenizer has no template and none is given.
        kwargs are the template's extra variables (vLLM's chat_template_kwargs, e.g. enable_thinking)."""
        return self.hf.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (Logprob.decoded_token); "" for an id the tokenizer cannot decode."""
        text = self._token_texts.get(token_id)
        if text is None:
            try:
                text = self.hf.decode([token_id], skip_special_tokens=False)
            except Exception:  # noqa: BLE001 (a negative or huge id, or a slow tokenizer's own lookup error)
                text = ""
            if 0 <= token_id < self.vocab_size:  # cache only real ids, so bad ids cannot grow the cache
                self._token_texts[token_id] = text
        return text
