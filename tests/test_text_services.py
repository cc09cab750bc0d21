"""The tokenizer and detokenizer services, served in-process on loopback ports, against the SmolLM2 tokenizer;
and as real processes where SIGTERM is the point."""

import queue

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import InProcessService, mesh_channel
from engine.models.loader import load_config
from engine.text import Tokenizer
from engine.text.detokenizer import REPLACEMENT_CHAR
from llmmesh.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.service_process import ServiceProcess

PROMPT = "Please repeat the following text exactly:\n"
HARD_TEXTS = {  # characters whose UTF-8 bytes SmolLM2 splits over several tokens
    "emoji": "Family 👨‍👩‍👧 and flags 🇫🇷🇯🇵, thumbs 👍🏽 up 🎉",
    "cjk": "你好，世界！日本語のテキスト",
}
MESSAGES = [
    common_pb2.ChatMessage(role="system", content="Be brief."),
    common_pb2.ChatMessage(role="user", content="Name a colour 🎨"),
]


@pytest.fixture(scope="module")
def addresses():
    services = {}
    try:
        for name in ("tokenizer", "detokenizer"):
            services[name] = InProcessService(name)
        yield {name: s.address for name, s in services.items()}
    finally:
        for s in services.values():
            s.stop()


def test_sigterm_stops_the_processes_cleanly():
    """As processes, both services drain on SIGTERM and exit 0."""
    processes = [ServiceProcess(name, ["--port", "0"]) for name in ("tokenizer", "detokenizer")]  # load in parallel
    try:
        for p in processes:
            p.wait_listening(120)
        for p in processes:
            p.terminate()
        for p in processes:
            assert p.popen.wait(30) == 0, f"the {p.service} exited with {p.popen.returncode}"
    finally:
        for p in processes:
            if p.alive():
                p.kill()


@pytest.fixture(scope="module")
def channels(addresses):
    chans = {name: mesh_channel(address) for name, address in addresses.items()}
    yield chans
    for chan in chans.values():
        chan.close()


@pytest.fixture(scope="module")
def tokenizer_stub(channels):
    return tokenizer_pb2_grpc.TokenizerStub(channels["tokenizer"])


@pytest.fixture(scope="module")
def detokenizer_stub(channels):
    return detokenizer_pb2_grpc.DetokenizerStub(channels["detokenizer"])


@pytest.fixture(scope="module")
def tok(tokenizer):
    return Tokenizer(tokenizer)


class Stream:
    """One Detokenize bidi stream, driven in lockstep: send a batch, get its reply batch."""

    def __init__(self, stub):
        self.requests = queue.Queue()
        self.replies = stub.Detokenize(iter(self.requests.get, None), timeout=60)

    def send(self, *items) -> list[detokenizer_pb2.DetokenizeResult]:
        self.requests.put(detokenizer_pb2.DetokenizeBatch(items=items))
        results = list(next(self.replies).results)
        assert [r.request_id for r in results] == [i.request_id for i in items]
        return results

    def close(self):
        self.requests.put(None)
        assert list(self.replies) == []  # the server ends the stream cleanly


def start(rid, prompt_ids, **kwargs):
    return detokenizer_pb2.DetokenizeItem(
        request_id=rid, start=detokenizer_pb2.DetokenizeStart(prompt_token_ids=prompt_ids, **kwargs)
    )


def step(rid, token_ids, **kwargs):
    return detokenizer_pb2.DetokenizeItem(
        request_id=rid, step=detokenizer_pb2.DetokenizeStep(token_ids=token_ids, **kwargs)
    )


def close(rid):
    return detokenizer_pb2.DetokenizeItem(request_id=rid, close=True)


def invalid_argument(call, *args) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call(*args)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value.details()


# ---------------------------------------------------------------------------------------------- both services


@pytest.mark.parametrize(
    "name,service", [("tokenizer", "llmmesh.v1.Tokenizer"), ("detokenizer", "llmmesh.v1.Detokenizer")]
)
def test_health_and_reflection(channels, name, service):
    health = health_pb2_grpc.HealthStub(channels[name])
    for s in ("", service):
        assert health.Check(health_pb2.HealthCheckRequest(service=s)).status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channels[name])
    reply = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {service, "grpc.health.v1.Health"} <= names


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenize_text(tokenizer_stub, tok):
    for text in [PROMPT, *HARD_TEXTS.values()]:
        reply = tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text))
        assert list(reply.token_ids) == tok.encode(text) and reply.prompt == text
    reply = tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=PROMPT, add_special_tokens=False))
    assert list(reply.token_ids) == tok.encode(PROMPT, add_special_tokens=False)


def test_tokenize_chat(tokenizer_stub, tok):
    messages = [{"role": m.role, "content": m.content} for m in MESSAGES]
    reply = tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.ChatInput(messages=MESSAGES)))
    prompt = tok.apply_chat_template(messages)
    assert reply.prompt == prompt and prompt.endswith("<|im_start|>assistant\n")
    assert list(reply.token_ids) == tok.encode(prompt, add_special_tokens=False)
    no_gen = tokenizer_stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.ChatInput(messages=MESSAGES, add_generation_prompt=False))
    )
    assert no_gen.prompt == tok.apply_chat_template(messages, add_generation_prompt=False) != prompt


CUSTOM_TEMPLATE = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"


def test_request_chat_template_only_when_trusted(tokenizer_stub, tok):
    custom = tokenizer_pb2.TokenizeRequest(
        chat=tokenizer_pb2.ChatInput(messages=MESSAGES, chat_template=CUSTOM_TEMPLATE)
    )
    details = invalid_argument(tokenizer_stub.Tokenize, custom)
    assert details.startswith("chat.chat_template") and "trust-request-chat-template" in details
    with (
        InProcessService("tokenizer", ["--trust-request-chat-template"]) as trusting,
        mesh_channel(trusting.address) as channel,
    ):
        reply = tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(custom)
    assert reply.prompt == "[system:Be brief.][user:Name a colour 🎨]"
    assert list(reply.token_ids) == tok.encode(reply.prompt, add_special_tokens=False)


def test_truncation(tokenizer_stub, tok):
    ids = tok.encode(PROMPT)
    assert len(ids) > 3
    reply = tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=PROMPT, truncate_prompt_tokens=3))
    assert list(reply.token_ids) == ids[-3:]
    long_text = "word " * 9000  # longer than the model's 8192 positions
    long_ids = tok.encode(long_text)
    reply = tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=long_text, truncate_prompt_tokens=-1))
    max_len = tokenizer_stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest()).model_max_length
    assert len(long_ids) > max_len and list(reply.token_ids) == long_ids[-max_len:]
    zero = tokenizer_pb2.TokenizeRequest(text=PROMPT, truncate_prompt_tokens=0)
    details = invalid_argument(tokenizer_stub.Tokenize, zero)
    assert "truncate_prompt_tokens" in details and "-1" in details


def test_tokenize_batch(tokenizer_stub, tok):
    requests = [
        tokenizer_pb2.TokenizeRequest(text=HARD_TEXTS["cjk"]),
        tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.ChatInput(messages=MESSAGES)),
        tokenizer_pb2.TokenizeRequest(text=PROMPT, truncate_prompt_tokens=2),
    ]
    reply = tokenizer_stub.TokenizeBatch(tokenizer_pb2.TokenizeBatchRequest(requests=requests))
    assert [list(r.token_ids) for r in reply.responses] == [
        list(tokenizer_stub.Tokenize(r).token_ids) for r in requests
    ]
    assert list(reply.responses[0].token_ids) == tok.encode(HARD_TEXTS["cjk"])
    bad = [
        requests[0],
        tokenizer_pb2.TokenizeRequest(
            chat=tokenizer_pb2.ChatInput(
                messages=[common_pb2.ChatMessage(role="user", content="hi"), common_pb2.ChatMessage(content="no role")]
            )
        ),
    ]
    details = invalid_argument(tokenizer_stub.TokenizeBatch, tokenizer_pb2.TokenizeBatchRequest(requests=bad))
    assert "requests[1].chat.messages[1].role" in details


def test_detokenize(tokenizer_stub, tok):
    for text in HARD_TEXTS.values():
        ids = tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text)).token_ids
        assert tokenizer_stub.Detokenize(tokenizer_pb2.DetokenizeTextRequest(token_ids=ids)).text == text
    chat = tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.ChatInput(messages=MESSAGES))
    chat_ids = tokenizer_stub.Tokenize(chat).token_ids
    with_special = tokenizer_stub.Detokenize(
        tokenizer_pb2.DetokenizeTextRequest(token_ids=chat_ids, skip_special_tokens=False)
    )
    assert with_special.text == tok.decode(chat_ids, skip_special_tokens=False) and "<|im_start|>" in with_special.text
    skipped = tokenizer_stub.Detokenize(tokenizer_pb2.DetokenizeTextRequest(token_ids=chat_ids))
    assert skipped.text == tok.decode(chat_ids) and "<|im_start|>" not in skipped.text
    for bad in (-1, tok.vocab_size):
        details = invalid_argument(tokenizer_stub.Detokenize, tokenizer_pb2.DetokenizeTextRequest(token_ids=[5, bad]))
        assert "token_ids[1]" in details and str(tok.vocab_size) in details


def test_tokenizer_info(tokenizer_stub, tok, smollm2_dir):
    info = tokenizer_stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
    config = load_config(smollm2_dir)
    assert info.vocab_size == tok.vocab_size == 49152
    assert info.model_max_length == config.max_position_embeddings == 8192
    assert tok.eos_token_id in info.eos_token_ids and set(config.eos_token_ids) <= set(info.eos_token_ids)
    assert info.HasField("bos_token_id") and info.bos_token_id == config.bos_token_id
    assert info.special_tokens["<|im_end|>"] == 2 and info.special_tokens["<|im_start|>"] == 1
    assert set(info.special_tokens.values()) == tok.all_special_ids
    assert info.has_chat_template


@pytest.mark.parametrize(
    "messages,field",
    [
        ([], "chat.messages"),
        ([common_pb2.ChatMessage(role="user", content="hi"), common_pb2.ChatMessage(content="x")], "messages[1].role"),
        ([common_pb2.ChatMessage(role="wizard", content="x")], "messages[0].role"),
    ],
    ids=["no-messages", "missing-role", "unknown-role"],
)
def test_malformed_chat(tokenizer_stub, tok, messages, field):
    request = tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.ChatInput(messages=messages))
    details = invalid_argument(tokenizer_stub.Tokenize, request)
    assert field in details
    if messages:
        assert "system, user, assistant, tool" in details  # the allowed values
    # The service goes on serving.
    assert list(tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="ok")).token_ids) == tok.encode("ok")


def test_tokenize_needs_input(tokenizer_stub):
    assert "input" in invalid_argument(tokenizer_stub.Tokenize, tokenizer_pb2.TokenizeRequest())


# ---------------------------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("name", HARD_TEXTS)
def test_stream_split_characters(detokenizer_stub, tok, name):
    ids = tok.encode(HARD_TEXTS[name])
    stream = Stream(detokenizer_stub)
    assert stream.send(start("r", tok.encode(PROMPT))) == [detokenizer_pb2.DetokenizeResult(request_id="r")]
    deltas = []
    for i, t in enumerate(ids):
        [result] = stream.send(step("r", [t], finished=i == len(ids) - 1, text_of_token_ids=[t]))
        assert list(result.token_texts) == [tok.token_text(t)]
        assert result.finished == (i == len(ids) - 1) and not result.error and not result.stop_str
        deltas.append(result.text)
    assert "".join(deltas) == tok.decode(ids) == HARD_TEXTS[name]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "" in deltas[:-1]  # some characters did span tokens, and were held until whole
    # The finished step dropped the request: its id is unknown now.
    [result] = stream.send(step("r", [ids[0]]))
    assert result.error and "not open" in result.error and result.finished
    stream.close()


def stop_case(tok):
    """Output ids, and a stop string whose text spans several of them (no single token holds it)."""
    text = "The quick brown fox jumps over the lazy dog. It was STOPPED there and more follows."
    ids = tok.encode(text)
    stop = "STOPPED there"
    begin, end = text.index(stop), text.index(stop) + len(stop)
    first = next(k for k in range(len(ids)) if len(tok.decode(ids[: k + 1])) > begin)  # the token it starts in
    last = next(k for k in range(len(ids)) if len(tok.decode(ids[: k + 1])) >= end)  # ...and ends in
    assert last - first >= 2
    return ids, text, stop


@pytest.mark.parametrize("include", [False, True])
def test_stream_stop_string(detokenizer_stub, tok, include):
    ids, text, stop = stop_case(tok)
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    stream = Stream(detokenizer_stub)
    stream.send(start("s", tok.encode(PROMPT), stop=["never", stop], include_stop_str_in_output=include))
    streamed = ""
    for t in ids:
        [result] = stream.send(step("s", [t]))
        streamed += result.text
        # Never a character of the stop string before the hit (without include): always a prefix of the final text.
        assert expected.startswith(streamed), (streamed, expected)
        if result.finished:
            break
    assert result.stop_str == stop and result.finished and not result.error
    assert streamed == expected
    # Tokens the engine sent before the caller's abort give nothing more.
    [late] = stream.send(step("s", ids[-2:], finished=True))
    assert late.text == "" and late.finished and late.stop_str == stop
    assert stream.send(close("s"))[0].finished
    stream.close()


def test_stream_min_tokens(detokenizer_stub, tok):
    # A stop string inside the first min_tokens tokens does not count.
    ids = tok.encode("ab ab ab ab ab ab ab ab")
    stream = Stream(detokenizer_stub)
    stream.send(start("m", tok.encode(PROMPT), stop=["ab"], min_tokens=3))
    out = "".join(r.text for t in ids for r in stream.send(step("m", [t])))
    out += stream.send(step("m", [], finished=True))[0].text
    assert [tok.decode([t]) for t in ids[:4]] == ["ab", " ab", " ab", " ab"]
    assert out == "ab ab ab "  # cut where the fourth token's "ab" starts
    stream.close()


def test_stream_multiplexed(detokenizer_stub, tok):
    # Many requests on one stream, starting at different steps, one batch per step with each live request's
    # next token; special tokens and stop strings differ per request.
    texts = [*HARD_TEXTS.values(), "def f(x):\n    return x * 2\n", "Hello there, general Kenobi!", "ok"] * 3
    ids = [tok.encode(t) for t in texts]
    stream = Stream(detokenizer_stub)
    out = {f"q{i}": "" for i in range(len(texts))}
    token_texts = {rid: [] for rid in out}
    finished = set()
    for s in range(max(len(x) for x in ids) + len(texts)):
        items = []
        for i, rid in enumerate(out):
            pos = s - i  # request i starts at step i
            if pos == 0:
                items.append(start(rid, tok.encode(PROMPT), stop=["Kenobi"] if i % 5 == 3 else []))
            elif 0 < pos <= len(ids[i]):
                t = ids[i][pos - 1]
                items.append(step(rid, [t], finished=pos == len(ids[i]), text_of_token_ids=[t, 0]))
        if not items:
            break
        for r in stream.send(*items):
            assert not r.error
            out[r.request_id] += r.text
            token_texts[r.request_id] += r.token_texts
            if r.finished:
                finished.add(r.request_id)
    assert finished == set(out)
    for i, rid in enumerate(out):
        expected = "Hello there, general " if i % 5 == 3 else texts[i]
        assert out[rid] == expected, rid
        assert token_texts[rid] == [x for t in ids[i] for x in (tok.token_text(t), "<|endoftext|>")]
    stream.close()


def test_stream_bad_items(detokenizer_stub, tok):
    ids = tok.encode("fine text")
    stream = Stream(detokenizer_stub)
    other = Stream(detokenizer_stub)
    other.send(start("a", []))
    results = stream.send(
        start("a", tok.encode(PROMPT)),
        step("ghost", [5]),  # step before start
        start("a", []),  # duplicate start: the request is dropped
        start("", []),  # no id
        start("b", [], stop=[""]),  # bad option
        start("c", [-3]),  # bad prompt id
        detokenizer_pb2.DetokenizeItem(request_id="d"),  # no kind
    )
    errors = [r.error for r in results]
    assert errors[0] == ""
    assert "items[1].step" in errors[1] and "'ghost'" in errors[1]
    assert "items[2].start" in errors[2] and "already started" in errors[2]
    assert "items[3].request_id" in errors[3]
    assert "items[4].start.stop" in errors[4]
    assert "items[5].start.prompt_token_ids[0]" in errors[5]
    assert "items[6]" in errors[6] and "start, step or close" in errors[6]
    assert all(r.finished for r in results[1:])
    # "a" on this stream is gone; "a" on the other stream is untouched and decodes normally.
    assert "not open" in stream.send(step("a", ids))[0].error
    assert other.send(step("a", ids, finished=True))[0].text == "fine text"
    # A bad token id ends only its request; another request in the same batch goes on.
    stream.send(start("x", []), start("y", []))
    bad, good = stream.send(step("x", [tok.vocab_size]), step("y", ids, finished=True))
    assert "items[0].step.token_ids[0]" in bad.error and good.text == "fine text" and not good.error
    stream.close()
    other.close()


def test_state_is_per_stream(detokenizer_stub, tok):
    first = Stream(detokenizer_stub)
    first.send(start("same", []))
    first.close()
    second = Stream(detokenizer_stub)
    assert "not open" in second.send(step("same", tok.encode("x")))[0].error  # the ended stream's state is gone
    second.close()


def test_the_gateways_stream_splits_a_turn_into_batches_the_detokenizer_takes(tok):
    """More items in one event-loop turn than the detokenizer's --max-batch: they leave as several batches, every
    item is answered, and the shared stream stays open (one over-full batch would end it for every request)."""
    import asyncio

    from conftest import aio_mesh_channel
    from services.detokenizer_client import DetokenizerStream

    async def run(address):
        async with aio_mesh_channel(address, server="detokenizer") as chan:
            stream = DetokenizerStream(detokenizer_pb2_grpc.DetokenizerStub(chan), address, max_batch=2)
            results: asyncio.Queue = asyncio.Queue()
            ids = [f"r{i}" for i in range(5)]
            stream.open(ids, results)
            start = detokenizer_pb2.DetokenizeStart(prompt_token_ids=tok.encode("Hi"))
            stream.send([detokenizer_pb2.DetokenizeItem(request_id=rid, start=start) for rid in ids])
            stream.send(
                [
                    detokenizer_pb2.DetokenizeItem(
                        request_id=rid, step=detokenizer_pb2.DetokenizeStep(token_ids=tok.encode(" there"))
                    )
                    for rid in ids
                ]
            )
            answers = [await asyncio.wait_for(results.get(), 30) for _ in range(10)]
            assert stream.error is None
            stream.cancel()
            return answers

    with InProcessService("detokenizer", ["--max-batch", "2"]) as detokenizer:
        answers = asyncio.run(run(detokenizer.address))
    assert all(not a.error for a in answers), [a.error for a in answers]
    assert sorted(a.text for a in answers if a.text) == [" there"] * 5
