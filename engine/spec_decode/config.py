"""SpeculativeConfig: vLLM's --speculative-config, checked when the engine starts."""

import json
from dataclasses import asdict, dataclass

from engine.json_object import parse_json_object

SPEC_METHODS = ("ngram", "draft_model")
# Drafts per step at most: each one is a position every step verifies.
MAX_SPECULATIVE_TOKENS = 16
# Longest n-gram prompt lookup matches (its work per step grows with it).
MAX_PROMPT_LOOKUP = 64
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # n-gram: the longest suffix of a request's tokens looked up in them
    prompt_lookup_min: int = 0  # n-gram: the shortest
    model: str | None = None  # draft_model: the draft's directory or .gguf file (the target's tokenizer)

    @classmethod
    def from_json(cls, value: "str | dict") -> "SpeculativeConfig":
        """Parse and check; every refusal is a ValueError naming the field and what it allows."""
        text = value if isinstance(value, str) else json.dumps(value)
        value = parse_json_object(text, "speculative_config", _FIELDS)
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, got {method!r}.")
        k = _int(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        if method == "ngram":
            if "model" in value:
                raise ValueError("speculative_config.model is for method draft_model only; ngram takes no model.")
            lookup_max = _int(value, "prompt_lookup_max", 5, 1, MAX_PROMPT_LOOKUP)
            lookup_min = _int(value, "prompt_lookup_min", min(2, lookup_max), 1, lookup_max)
            return cls(method, k, lookup_max, lookup_min)
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model is required for method draft_model: the draft model's path.")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if name in value:
                raise ValueError(f"speculative_config.{name} is for method ngram only.")
        return cls(method, k, model=model)

    def to_dict(self) -> dict:
        """The fields from_json takes back: those of this method (the others are unset: None or 0)."""
        return {k: v for k, v in asdict(self).items() if v}


def _int(value: dict, name: str, default: int | None, low: int, high: int) -> int:
    v = value.get(name, default)
    if v is None:
        raise ValueError(f"speculative_config.{name} is required: an integer in [{low}, {high}].")
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {v!r}.")
    return v
