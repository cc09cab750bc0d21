"""Output token ids -> text, a token at a time, and the stop strings found in that text (vLLM v1's detokenizer).

A decoder step returns only the text the new token adds. When a character's UTF-8 bytes are split over
several tokens, the step returns "" until the last of them arrives, so no delta ends in a half character.
If the model generates bytes that never form a character, they come out as U+FFFD (as tokenizer.decode
shows them): in the middle of the text once a later token makes the rest decodable, or at the end, when
the request finishes (flush). So the deltas of a request add up to tokenizer.decode of its output ids.
"""

import logging
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.request import SamplingParams

logger = logging.getLogger("llmmesh.detokenizer")

REPLACEMENT_CHAR = "\ufffd"  # what decoding gives for bytes that are not (yet) a whole character
# The decoders start from the end of the prompt, so that the first output token is decoded in context.
_MIN_PROMPT_CONTEXT = 4
MAX_PROMPT_CONTEXT = 24


def prompt_context(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """The last few prompt ids: the shortest suffix of 4 to 24 that starts on a whole character.

    The decoders step through these first and drop the text, so the first output token is decoded in context.
    If the prompt ends inside a character, its last tokens stay held, so the output's first text is theirs
    completed: the whole character, and anything else in those tokens (e.g. a space before it).
    """
    ids = list(prompt_token_ids)
    for n in range(_MIN_PROMPT_CONTEXT, min(len(ids), MAX_PROMPT_CONTEXT) + 1):
        if not tokenizer.decode(ids[-n:], skip_special_tokens=False).startswith(REPLACEMENT_CHAR):
            return ids[-n:]
    return ids[-_MIN_PROMPT_CONTEXT:]


class IncrementalDecoder:
    """Turns output token ids into text one id at a time; step() returns only the new text."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens=True,
                 spaces_between_special_tokens=True):  # fmt: skip
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # vLLM's meaning of spaces_between_special_tokens=False: an added token right after another one gives
        # its bare text, without any separator the tokenizer's decoder would put in front of it.
        self.join_added_tokens = not skip_special_tokens and not spaces_between_special_tokens
        self.prev_was_added = False
        self._start()
        # The prompt's tail is decoded first, as context for the first output token; none of it is returned.
        for token_id in prompt_context(tokenizer, prompt_token_ids):
            self._step(token_id)
        self._prompt_done()

    def _start(self) -> None:
        """Set up the decoding state, before the prompt's context runs through _step."""

    def _prompt_done(self) -> None:
        """The prompt's context has run through _step."""

    def step(self, token_id: int) -> str:
        text = self._step(token_id)
        if self.join_added_tokens:
            added_text = self.tokenizer.added_token_texts.get(token_id)
            if added_text is not None and self.prev_was_added:
                text = added_text
            self.prev_was_added = added_text is not None
        return text

    def _step(self, token_id: int) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        """The text of the tokens still held back, as it stands (bytes that never completed are U+FFFD)."""
        raise NotImplementedError


class StreamDecoder(IncrementalDecoder):
    """tokenizers' DecodeStream: the Rust side keeps the window and holds split characters (step returns None)."""

    def _start(self) -> None:
        if self.tokenizer.backend is None:
            raise ValueError("DecodeStream needs a fast tokenizer (one with a tokenizers backend)")
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        # The ids fed to the stream, and how many of them are out as text; the rest are held (for flush). The
        # prompt is stepped one by one rather than passed as DecodeStream(ids=...): with that, a prompt ending
        # inside a character made the first step return the prompt's text again (tokenizers 0.23).
        self.ids: list[int] = []
        self.num_emitted = 0

    def _prompt_done(self) -> None:
        self.num_emitted = len(self.ids)  # bytes of a prompt's unfinished character are never flushed

    def _step(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.tokenizer.backend, token_id)
        except (OverflowError, TypeError):
            return ""  # not an unsigned 32-bit id, so no token at all
        except Exception as e:  # noqa: BLE001 (tokenizers' own errors: see below)
            # tokenizers raises "Invalid prefix encountered" when the window's text stops extending what was
            # already returned (a decoder that rewrites earlier text). The returned text stands; start a fresh
            # stream at this token, which only loses this token's context.
            logger.warning("DecodeStream failed on token %d (%s); restarting the stream", token_id, e)
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self.num_emitted = len(self.ids)
            try:
                text = self.stream.step(self.tokenizer.backend, token_id)
            except Exception as e:  # noqa: BLE001 (this token cannot be decoded at all: it is skipped)
                logger.warning("DecodeStream cannot decode token %d alone either (%s); skipping it", token_id, e)
                return ""
        self.ids.append(token_id)
        if text is None:
            return ""
        self.num_emitted = len(self.ids)
        return text

    def flush(self) -> str:
        held = self.ids[self.num_emitted :]
        if not held:
            return ""
        # Decode the held ids after a few emitted ones, so they keep their context, and take the difference.
        context = self.ids[max(0, self.num_emitted - _MIN_PROMPT_CONTEXT) : self.num_emitted]
        before = self.tokenizer.backend.decode(context, skip_special_tokens=self.skip_special_tokens)
        after = self.tokenizer.backend.decode(context + held, skip_special_tokens=self.skip_special_tokens)
        self.num_emitted = len(self.ids)
        return after[len(before) :] if after.startswith(before) else ""


class OffsetDecoder(IncrementalDecoder):
    """The prefix/read-offset method, for tokenizers without a Rust backend.

    tokens[read_offset:] are not out as text yet. Each step decodes the window tokens[prefix_offset:] with and
    without the unread tokens and returns the difference; starting the window at the tokens emitted last gives
    the decoder the context it needs (leading spaces, merges). A window ending in U+FFFD means a character is
    still incomplete, so nothing is returned and the offsets stay.
    """

    def _start(self) -> None:
        self.tokens: list[str] = []
        self.prefix_offset = self.read_offset = 0

    def _prompt_done(self) -> None:
        self.num_prompt_tokens = len(self.tokens)

    def _to_tokens(self, token_ids) -> list[str]:
        tokens = []
        for token_id in token_ids:
            if self.skip_special_tokens and token_id in self.tokenizer.all_special_ids:
                continue
            try:
                token = self.tokenizer.hf.convert_ids_to_tokens(token_id)
            except Exception:  # noqa: BLE001 (negative or huge ids; slow tokenizers raise their own lookup errors)
                token = None
            if token is not None:  # None: an id past the vocabulary, which decodes to nothing
                tokens.append(token)
        return tokens

    def _step(self, token_id: int) -> str:
        self.tokens += self._to_tokens([token_id])
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        if len(self.tokens) == self.num_prompt_tokens:
            return ""  # only a prompt's unfinished character is held: not output text
        return self._advance(hold_incomplete=False)

    def _advance(self, hold_incomplete: bool) -> str:
        to_text = self.tokenizer.hf.convert_tokens_to_string
        prefix_text = to_text(self.tokens[self.prefix_offset : self.read_offset])
        new_text = to_text(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text) :]


def find_stop_string(text: str, new_from: int, stop: list[str]) -> tuple[int, str] | None:
    """The earliest-starting stop string in `text` that ends after position `new_from` (text before it was
    searched already): (where it starts, the string), or None. On a tie the one listed first wins."""
    found = None
    for s in stop:
        start = text.find(s, max(0, new_from - len(s) + 1))
        if start != -1 and (found is None or start < found[0]):
            found = (start, s)
    return found


class RequestDetokenizer:
    """One request's output text: decodes its tokens, cuts the text at a stop string, and hands out what may be
    streamed."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: "SamplingParams",
        use_decode_stream: bool | None = None,
    ):
        self.output_text = ""
        self.stop = list(params.stop) if params.detokenize else []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens  # stop strings only count after this many output tokens, as in vLLM
        self.num_output_tokens = 0
        self.matched_stop: str | None = None
        # While running, the text's tail may be the start of a stop string that will be cut off, so it is not
        # streamed until the request finishes or more text shows it is not one.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.num_sent = 0  # characters of output_text already returned as deltas
        self.decoder: IncrementalDecoder | None = None
        if params.detokenize:
            if use_decode_stream is None:
                use_decode_stream = tokenizer.backend is not None
            decoder_class = StreamDecoder if use_decode_stream else OffsetDecoder
            self.decoder = decoder_class(
                tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Decode new tokens and look for stop strings. stop_terminated: the engine stopped the request on the last
        of these tokens (EOS or a stop_token_id); that token's text is then left out unless
        include_stop_str_in_output. Returns the stop string that matched (output_text then ends before it, or just
        after it with include_stop_str_in_output), else None. After a match, further tokens in the same call are
        ignored."""
        if self.decoder is None or self.matched_stop is not None:
            return None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        # One token at a time, so the result does not depend on how the engine batched the tokens.
        for token_id in new_token_ids:
            self.num_output_tokens += 1
            if self._append(self.decoder.step(token_id)):
                return self.matched_stop
        return None

    def _append(self, text: str) -> bool:
        """Add decoded text and cut output_text at a stop string it completes; True if it did."""
        new_from = len(self.output_text)
        self.output_text += text
        if not text or not self.stop or self.num_output_tokens <= self.min_tokens:
            return False
        found = find_stop_string(self.output_text, new_from, self.stop)
        if found is None:
            return False
        start, self.matched_stop = found
        end = start + len(self.matched_stop) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:end]
        return True

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """delta=True: only the text not returned before; otherwise all of output_text.
        Unless finished, hold back the last len(longest stop string)-1 characters (only when there are stop strings
        and not include_stop_str_in_output), so no prefix of a stop string is ever streamed and then taken back."""
        if finished and self.decoder is not None and self.matched_stop is None:
            # Nothing more will come: bytes still waiting for the rest of a character come out now, as U+FFFD.
            self._append(self.decoder.flush())
        end = len(self.output_text) if finished else max(len(self.output_text) - self.stop_buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        text = self.output_text[self.num_sent : end]
        self.num_sent = max(self.num_sent, end)
        return text
