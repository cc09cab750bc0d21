"""The text egress library on the real SmolLM2 tokenizer: tokenizer wrapper, incremental detokenizer, stop strings."""

import pytest

from engine.request import SamplingParams
from engine.text.detokenizer import REPLACEMENT_CHAR, RequestDetokenizer, StreamDecoder, find_stop_string
from engine.text.tokenizer import Tokenizer

PROMPT = "Please repeat the following text exactly:\n"

# Each has characters whose UTF-8 bytes SmolLM2 splits over two or more tokens.
HARD_TEXTS = {
    "emoji": "Family 👨‍👩‍👧 and flags 🇫🇷🇯🇵, thumbs 👍🏽 up 🎉",
    "cjk": "你好，世界！日本語のテキスト",
    "accents": "Zażółć gęślą jaźń, crème brûlée",
    "code": 'def área(r):\n    """≈ π r²"""\n    return 3.14159 * r ** 2  # ≈\n',
}
PATHS = {"decode_stream": True, "offset": False}


@pytest.fixture(scope="module")
def tok(tokenizer):
    return Tokenizer(tokenizer)


def stream(tok, output_ids, use_decode_stream, prompt=PROMPT, stop_terminated_last=False, **params):
    """Feed output_ids one at a time as the engine does; the streamed deltas (the last one at finish) and the
    detokenizer."""
    prompt_ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    detok = RequestDetokenizer(tok, prompt_ids, SamplingParams(**params), use_decode_stream)
    deltas = []
    for i, token_id in enumerate(output_ids):
        last = i == len(output_ids) - 1
        if detok.update([token_id], stop_terminated_last and last) is not None:
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, detok


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_basics(tok, smollm2_dir):
    assert Tokenizer.from_pretrained(smollm2_dir).encode("hello world") == tok.encode("hello world")
    assert tok.backend is not None
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2
    assert tok.all_special_ids == set(range(17))  # every added token of SmolLM2 is special
    for text in HARD_TEXTS.values():
        ids = tok.encode(text)
        assert len(ids) > 1
        assert tok.decode(ids) == text
    assert tok.decode([1, 9690, 2]) == "system"
    assert tok.decode([1, 9690, 2], skip_special_tokens=False) == "<|im_start|>system<|im_end|>"


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without == prompt.removesuffix("<|im_start|>assistant\n")
    custom = tok.apply_chat_template(messages, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert custom == "[Be brief.][hi]"


def test_token_text(tok):
    world = tok.encode(" world")
    assert len(world) == 1 and tok.token_text(world[0]) == " world"
    assert tok.token_text(2) == "<|im_end|>"  # special tokens show in logprobs
    for bad in (-1, tok.vocab_size, 10**6, 2**40):
        assert tok.token_text(bad) == ""


# ---------------------------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("name", HARD_TEXTS)
def test_stream_split_characters(tok, name, use_decode_stream):
    ids = tok.encode(HARD_TEXTS[name])
    deltas, detok = stream(tok, ids, use_decode_stream)
    assert "".join(deltas) == tok.decode(ids) == HARD_TEXTS[name]
    assert detok.output_text == HARD_TEXTS[name]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    # A step gives no text exactly when the ids so far end inside a character.
    held = [i for i, d in enumerate(deltas[:-1]) if d == ""]
    incomplete = [i for i in range(len(ids)) if tok.decode(ids[: i + 1]).endswith(REPLACEMENT_CHAR)]
    assert held == incomplete
    assert held, "the text should split a character over tokens"


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("spaces_between", [True, False])
@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_special_tokens(tok, skip_special, spaces_between, use_decode_stream):
    # Special tokens right after split characters, two and three in a row, and at the end.
    ids = tok.encode("Hi 👋") + [2, 1] + tok.encode("assistant\nok 日本") + [5, 2, 0]
    deltas, _ = stream(
        tok,
        ids,
        use_decode_stream,
        prompt="<|im_start|>user\nhey<|im_end|>\n",
        skip_special_tokens=skip_special,
        spaces_between_special_tokens=spaces_between,
    )
    expected = tok.decode(ids, skip_special_tokens=skip_special, spaces_between_special_tokens=spaces_between)
    assert "".join(deltas) == expected
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    if skip_special:
        assert expected == "Hi 👋assistant\nok 日本"
    else:
        assert expected == "Hi 👋<|im_end|><|im_start|>assistant\nok 日本<file_sep><|im_end|><|endoftext|>"


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
# 𓀀 takes four one-byte tokens, so a short window of the prompt can start and end inside characters.
@pytest.mark.parametrize("text", ["We 👨‍👩‍👧 are 日本 here", "Egyptian 𓀀𓀁𓀂 ok"])
def test_prompt_ending_anywhere(tok, text, use_decode_stream):
    # Every place to end the prompt, including inside a character. The output never repeats prompt text, except
    # that prompt tokens holding part of a character come out with the rest of it.
    ids = tok.encode(text)
    num_split_prompts = 0
    for cut in range(1, len(ids)):
        whole = max(j for j in range(cut + 1) if not tok.decode(ids[:j]).endswith(REPLACEMENT_CHAR))
        num_split_prompts += whole < cut
        deltas, _ = stream(tok, ids[cut:], use_decode_stream, prompt=ids[:cut])
        expected = tok.decode(ids)[len(tok.decode(ids[:whole])) :]
        assert "".join(deltas) == expected, f"prompt {tok.decode(ids[:cut])!r}"
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        # The prompt's unfinished character is not output text: an output of just EOS flushes nothing.
        deltas, _ = stream(tok, [2], use_decode_stream, prompt=ids[:cut], stop_terminated_last=True)
        assert deltas == ["", ""]
    assert num_split_prompts >= 5


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
def test_spaces_between_special_tokens(smollm2_dir, use_decode_stream):
    # SmolLM2's byte-level decoder never puts spaces around special tokens (and transformers 5's decode ignores
    # the flag), so try vLLM's rule on a decoder that joins every token with a space, as BERT's WordPiece does.
    from tokenizers import decoders

    spaced = Tokenizer.from_pretrained(smollm2_dir)
    spaced.backend.decoder = decoders.WordPiece()
    ids = spaced.encode("hello") + [2, 1, 0]
    assert spaced.decode(ids, skip_special_tokens=False) == "hello <|im_end|> <|im_start|> <|endoftext|>"
    outputs = {}
    for spaces_between in (True, False):
        deltas, _ = stream(
            spaced,
            ids,
            use_decode_stream,
            prompt="Say",
            skip_special_tokens=False,
            spaces_between_special_tokens=spaces_between,
        )
        outputs[spaces_between] = "".join(deltas)
    # A special token right after another one comes out bare, without the decoder's space.
    assert outputs[True] == " hello <|im_end|> <|im_start|> <|endoftext|>"
    assert outputs[False] == " hello <|im_end|><|im_start|><|endoftext|>"


def test_default_path_follows_backend(tok):
    assert isinstance(RequestDetokenizer(tok, [1], SamplingParams()).decoder, StreamDecoder)
    slow = Tokenizer(tok.hf)
    slow.backend = None  # as if the tokenizer were a slow (pure Python) one
    detok = RequestDetokenizer(slow, tok.encode(PROMPT), SamplingParams())
    assert not isinstance(detok.decoder, StreamDecoder)
    ids = tok.encode(HARD_TEXTS["emoji"])
    detok.update(ids, False)
    assert detok.output_text == HARD_TEXTS["emoji"]
    with pytest.raises(ValueError, match="fast tokenizer"):
        RequestDetokenizer(slow, [1], SamplingParams(), use_decode_stream=True)


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
def test_invalid_bytes(tok, use_decode_stream):
    lead_byte = tok.hf.convert_tokens_to_ids("ð")  # 0xF0 alone: the start of a 4-byte character
    assert tok.decode([lead_byte]) == REPLACEMENT_CHAR
    # In the middle, the broken character comes out once later text is decodable...
    ids = tok.encode("ok") + [lead_byte] + tok.encode(" fine")
    deltas, _ = stream(tok, ids, use_decode_stream)
    assert deltas == ["ok", "", REPLACEMENT_CHAR + " fine", ""]
    assert "".join(deltas) == tok.decode(ids)
    # ...and at the end it is flushed when the request finishes, even when the finishing token is left out.
    ids = tok.encode("ok") + [lead_byte, 2]
    deltas, detok = stream(tok, ids, use_decode_stream, stop_terminated_last=True)
    assert deltas == ["ok", "", "", REPLACEMENT_CHAR]
    assert detok.output_text == "ok" + REPLACEMENT_CHAR


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
def test_bad_ids_do_not_raise(tok, use_decode_stream):
    ids = tok.encode("a b") + [-1, tok.vocab_size + 7, 2**40] + tok.encode(" c")
    deltas, _ = stream(tok, ids, use_decode_stream)
    assert "".join(deltas) == "a b c"


def test_decode_stream_error_recovers(tok):
    ids = tok.encode("one two three four")
    detok = RequestDetokenizer(tok, tok.encode(PROMPT), SamplingParams())

    class BrokenStream:
        def step(self, backend, token_id):
            raise Exception("Invalid prefix encountered")

    detok.update(ids[:2], False)
    broken = detok.decoder.stream = BrokenStream()
    detok.update(ids[2:], False)
    assert detok.output_text == "one two three four"
    assert detok.decoder.stream is not broken  # replaced by a fresh stream


def test_detokenize_off(tok):
    detok = RequestDetokenizer(tok, [1], SamplingParams(detokenize=False))
    assert detok.update(tok.encode("hello world"), False) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=True, delta=True) == ""


# ---------------------------------------------------------------------------------------------- stop strings

ANSWER = "The answer is 42. Thank you for asking!"


def token_spans(tok, ids):
    """(start, end) of each token's text within the decoded text (every token here decodes to whole characters)."""
    spans, pos = [], 0
    for i in range(len(ids)):
        end = len(tok.decode(ids[: i + 1]))
        spans.append((pos, end))
        pos = end
    return spans


def token_ending_at_or_after(spans, position):
    return next(i for i, (_, end) in enumerate(spans) if end >= position)


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["Thank you", "2. Than"])
def test_stop_string_across_tokens(tok, stop, include, use_decode_stream):
    ids = tok.encode(ANSWER)
    spans = token_spans(tok, ids)
    start = ANSWER.index(stop)
    first, last = token_ending_at_or_after(spans, start + 1), token_ending_at_or_after(spans, start + len(stop))
    assert last > first, "the stop string should span tokens"

    params = SamplingParams(stop=["never there", stop], include_stop_str_in_output=include)
    detok = RequestDetokenizer(tok, tok.encode(PROMPT), params, use_decode_stream)
    expected = ANSWER[: start + len(stop)] if include else ANSWER[:start]
    streamed = ""
    for i, token_id in enumerate(ids):
        matched = detok.update([token_id], False)
        assert matched == (stop if i == last else None)
        streamed += detok.get_next_output_text(finished=matched is not None, delta=True)
        assert detok.get_next_output_text(finished=matched is not None, delta=False) == streamed
        # Nothing streamed is ever taken back: every step's text is a prefix of the final text.
        assert expected.startswith(streamed)
        if i == last - 1:
            decoded_before_match, streamed_before_match = detok.output_text, streamed
        if matched:
            break
    assert streamed == detok.output_text == expected
    # The step before the match had decoded the start of the stop string already...
    assert len(decoded_before_match) > start
    if not include:
        assert len(streamed_before_match) <= start  # ...but not streamed it
    # A later call (a step the engine ran before it was told to abort) changes nothing.
    assert detok.update(tok.encode(" More text."), False) is None
    assert detok.output_text == expected


def test_stop_prefix_held_while_running(tok):
    ids = tok.encode("The answer is 42. Thank")
    params = SamplingParams(stop=["Thank you"])
    detok = RequestDetokenizer(tok, [1], params)
    assert detok.update(ids, False) is None
    assert detok.output_text == "The answer is 42. Thank"
    # 8 characters (len("Thank you") - 1) are held while running; all of it once finished without a match.
    assert detok.get_next_output_text(finished=False, delta=False) == "The answer is 4"
    assert detok.get_next_output_text(finished=False, delta=True) == "The answer is 4"
    assert detok.get_next_output_text(finished=True, delta=True) == "2. Thank"
    assert detok.get_next_output_text(finished=True, delta=False) == "The answer is 42. Thank"
    # With include_stop_str_in_output nothing needs holding back.
    detok = RequestDetokenizer(tok, [1], SamplingParams(stop=["Thank you"], include_stop_str_in_output=True))
    detok.update(ids, False)
    assert detok.get_next_output_text(finished=False, delta=True) == "The answer is 42. Thank"


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
def test_earliest_stop_string_wins(tok, use_decode_stream):
    ids = tok.encode(ANSWER)
    # Both complete on the token " you"; "Thank you" starts earlier, whatever the order of the list.
    for stop in (["you", "Thank you"], ["Thank you", "you"]):
        detok = RequestDetokenizer(tok, [1], SamplingParams(stop=stop), use_decode_stream)
        assert detok.update(ids, False) == "Thank you"
        assert detok.output_text == "The answer is 42. "
    # Given several tokens at once, a stop string completed by an earlier token wins, and the rest are ignored.
    detok = RequestDetokenizer(tok, [1], SamplingParams(stop=["Thank you", "42"]), use_decode_stream)
    assert detok.update(ids, False) == "42"
    assert detok.output_text == "The answer is "
    spans = token_spans(tok, ids)
    assert detok.num_output_tokens == token_ending_at_or_after(spans, ANSWER.index("42") + 2) + 1 < len(ids)


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_a_token(tok, include, use_decode_stream):
    ids = tok.encode(ANSWER)
    spans = token_spans(tok, ids)
    stop = "answ"  # ends inside the token " answer"
    end = ANSWER.index(stop) + len(stop)
    token = token_ending_at_or_after(spans, end)
    assert spans[token][1] > end and spans[token][0] < ANSWER.index(stop)
    detok = RequestDetokenizer(
        tok, [1], SamplingParams(stop=[stop], include_stop_str_in_output=include), use_decode_stream
    )
    for i, token_id in enumerate(ids):  # noqa: B007 (i is read after the loop)
        if detok.update([token_id], False):
            break
    assert i == token
    assert detok.output_text == ("The answ" if include else "The ")
    assert detok.get_next_output_text(finished=True, delta=True) == detok.output_text


@pytest.mark.parametrize("use_decode_stream", PATHS.values(), ids=PATHS.keys())
def test_stop_string_in_split_character(tok, use_decode_stream):
    # A stop string made of one emoji, whose bytes take three tokens: found when the last one arrives.
    ids = tok.encode("Yes 🎉 done")
    assert [tok.decode(ids[: i + 1]).endswith(REPLACEMENT_CHAR) for i in range(4)] == [False, True, True, False]
    detok = RequestDetokenizer(tok, [1], SamplingParams(stop=["🎉"]), use_decode_stream)
    assert [detok.update([token_id], False) for token_id in ids[:4]] == [None, None, None, "🎉"]
    assert detok.output_text == "Yes "


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_leaves_out_the_last_token(tok, include):
    ids = tok.encode("Hi there") + [2]  # EOS
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = RequestDetokenizer(tok, [1], params)
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.output_text == ("Hi there<|im_end|>" if include else "Hi there")
    # A stop_token_id that is an ordinary token: its text is left out the same way.
    ids = tok.encode("Hi there.")
    assert tok.decode(ids[-1:]) == "."
    detok = RequestDetokenizer(tok, [1], SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include))
    for i, token_id in enumerate(ids):
        assert detok.update([token_id], stop_terminated=i == len(ids) - 1) is None
    assert detok.get_next_output_text(finished=True, delta=False) == ("Hi there." if include else "Hi there")


def test_stop_strings_ignored_within_min_tokens(tok):
    ids = tok.encode("stop here, then stop again")
    detok = RequestDetokenizer(tok, [1], SamplingParams(stop=["stop"], min_tokens=3))
    assert detok.update(ids, False) == "stop"
    assert detok.output_text == "stop here, then "


def test_find_stop_string():
    # Only matches ending after new_from count; earlier text was searched already.
    assert find_stop_string("abcabc", 4, ["abc"]) == (3, "abc")
    assert find_stop_string("abcxyz", 3, ["abc"]) is None
    assert find_stop_string("abcxyz", 2, ["abc"]) == (0, "abc")
    assert find_stop_string("xxabcd", 5, ["cd", "bc", "abcd"]) == (2, "abcd")
    assert find_stop_string("xxabcd", 5, ["cd", "bcd"]) == (3, "bcd")
