"""RequestLimits: the configured caps a request is checked against before anything is allocated for it.

Every number a client sends that something is sized by (n completions, stop strings, logit_bias
entries, ...) has a cap here, so one request can never grow a process without bound. A process
checks a request once, where it enters (the gateway, the engine's gRPC protocols, the text services);
the offline LLM trusts its caller and checks only the model's own limits.
"""

import dataclasses
from dataclasses import dataclass

from engine.config.utils import setting


@dataclass
class RequestLimits:
    """The caps a request is checked against where it enters a process (docs/api.md, request limits)."""

    max_n: int = setting(128, help="completions (n) one request may ask for")  # OpenAI's cap
    max_stop: int = setting(64, help="stop strings per request")
    max_stop_chars: int = setting(1024, help="characters in one stop string")
    max_stop_token_ids: int = setting(1024, help="stop_token_ids per request")
    max_bad_words: int = setting(1024, help="bad_words per request")
    max_bad_word_chars: int = setting(1024, help="characters in one of the bad_words")
    max_logit_bias: int = setting(1024, help="logit_bias entries per request")
    max_allowed_token_ids: int = setting(65536, help="allowed_token_ids per request")
    max_structured_output_chars: int = setting(
        1 << 16,
        help="characters in a structured-output constraint (a JSON schema, regex, grammar or "
        "structural tag; a choice list's strings together): grammars compile from them",
    )
    max_messages: int = setting(1024, help="chat messages per request")
    max_prompt_chars: int = setting(
        1 << 20, help="characters of a prompt's text, or of all chat messages' content together"
    )
    max_id_chars: int = setting(256, help="characters in a request id or a cache salt")
    max_batch: int = setting(1024, help="requests in one TokenizeBatch, items in one detokenizer batch")
    max_open_requests: int = setting(16384, help="requests open at once on one detokenizer stream")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"--{f.name.replace('_', '-')} must be at least 1, got {getattr(self, f.name)}.")

    def check_count(self, field: str, count: int, limit_name: str) -> None:
        limit = getattr(self, limit_name)
        if count > limit:
            flag = "--" + limit_name.replace("_", "-")
            raise ValueError(f"{field} has {count} entries; at most {limit} are allowed ({flag}={limit}).")

    def check_chars(self, field: str, text: str, limit_name: str) -> None:
        limit = getattr(self, limit_name)
        if len(text) > limit:
            flag = "--" + limit_name.replace("_", "-")
            raise ValueError(f"{field} is {len(text)} characters long; at most {limit} are allowed ({flag}={limit}).")

    def check_params(self, params, max_model_len: int | None = None) -> None:
        """The caps on what a request's SamplingParams make a process hold; ValueError names the field."""
        if params.n > self.max_n:
            raise ValueError(f"n must be at most {self.max_n} (--max-n), got {params.n}.")
        if max_model_len is not None and params.max_tokens is not None and params.max_tokens > max_model_len:
            raise ValueError(
                f"max_tokens must be at most the model's length, {max_model_len}, got {params.max_tokens}."
            )
        self.check_count("stop", len(params.stop), "max_stop")
        for i, stop in enumerate(params.stop):
            self.check_chars(f"stop[{i}]", stop, "max_stop_chars")
        self.check_count("stop_token_ids", len(params.stop_token_ids), "max_stop_token_ids")
        self.check_count("bad_words", len(params.bad_words), "max_bad_words")
        for i, word in enumerate(params.bad_words):
            self.check_chars(f"bad_words[{i}]", word, "max_bad_word_chars")
        self.check_count("logit_bias", len(params.logit_bias or ()), "max_logit_bias")
        self.check_count("allowed_token_ids", len(params.allowed_token_ids or ()), "max_allowed_token_ids")
        constraint = params.structured_outputs
        if constraint is not None and constraint.kind != "json_object":
            value = getattr(constraint, constraint.kind)
            text = "".join(value) if constraint.kind == "choice" else value
            self.check_chars(f"structured_outputs.{constraint.kind}", text, "max_structured_output_chars")

    def check_id(self, field: str, value: str) -> None:
        self.check_chars(field, value, "max_id_chars")
