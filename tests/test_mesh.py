"""The whole mesh as real processes on loopback (engine, tokenizer, detokenizer, gateway), driven through
the public llmmesh.v1.Gateway and checked against the offline LLM on the real SmolLM2."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import NOT_SERVING, SERVING, mesh_channel, wait_for_health
from engine import LLM, SamplingParams
from engine.config import EngineArgs
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, tokenizer_pb2
from services.client import chat, collect, gateway_stub, generate
from services.local_mesh import Mesh

pytestmark = pytest.mark.slow

KV = "256MiB"
PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Three facts about the Moon:",
    "Once upon a time, in a small village,",
]
CHAT = [{"role": "user", "content": "Write a haiku about paged memory."}]
GREEDY = dict(temperature=0.0, max_tokens=16)
LONG = dict(temperature=0.0, max_tokens=1000, ignore_eos=True)  # runs far longer than any check needs


@pytest.fixture(scope="module")
def mesh(request):
    # As `llmmesh serve` runs it: with Redis and the kvstore behind the engine's KV connector.
    m = Mesh(EngineArgs(kv_cache_memory=KV), kv_store=True)
    m.launch()
    try:
        request.getfixturevalue("refs")  # the offline references, while the services load
        m.wait()
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=KV)


# Every reference output, from one batched offline run: (prompt, params) by name.
VARIANTS = PROMPTS + [f"{PROMPTS[i % 4]} (variant {i})" for i in range(4, 32)]
N2 = dict(temperature=0.8, seed=7, n=2, max_tokens=12, logprobs=2)
# Two seeded samples that differ within a few tokens; a stop string in one alone ends it early.
N2_LONG = dict(temperature=1.0, seed=3, n=2, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def refs(llm):
    tok = llm.tokenizer
    # What LLM.chat sends to the engine: the rendered template, tokenized without extra special tokens.
    chat_ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    jobs = {f"greedy{i}": (p, GREEDY) for i, p in enumerate(VARIANTS)}
    jobs["chat"] = ({"prompt_token_ids": chat_ids}, GREEDY)
    jobs["n2"] = (PROMPTS[0], N2)
    jobs["n2_long"] = (PROMPTS[2], N2_LONG)
    outputs = llm.generate(
        [p for p, _ in jobs.values()], [SamplingParams(**params) for _, params in jobs.values()], use_tqdm=False
    )
    return {name: out.outputs if name.startswith("n2") else out.outputs[0] for name, out in zip(jobs, outputs)}


@pytest.fixture(scope="module")
def engine(mesh):
    return engine_pb2_grpc.EngineStub(mesh_channel(mesh.services["engine"].address))


# The engine publishes its load after every step and has no event for it, so the waits below poll; their
# bounds keep a broken abort from hanging a test (the requests they wait out run for minutes), no speed is asserted.
IDLE_WITHIN_S = 30.0


def wait_idle(engine, timeout=IDLE_WITHIN_S) -> None:
    """Wait until the engine runs nothing and every KV block is free; fail after timeout."""
    start = time.monotonic()
    while True:
        load = engine.GetLoad(engine_pb2.GetLoadRequest())
        if load.num_running == 0 and load.num_waiting == 0 and load.kv_cache_usage == 0.0:
            return
        assert time.monotonic() - start < timeout, f"engine still busy after {timeout} s: {load}"
        time.sleep(0.01)


def wait_running(engine, count=1, timeout=30.0):
    start = time.monotonic()
    while True:
        load = engine.GetLoad(engine_pb2.GetLoadRequest())
        if load.num_running >= count and load.kv_cache_usage > 0:
            return load
        assert time.monotonic() - start < timeout, f"engine never ran {count} requests: {load}"
        time.sleep(0.01)


def first_chunks(stream, n=2):
    """Read the first n chunks (the request is then running in the engine)."""
    seen = 0
    for response in stream:
        assert response.HasField("chunk")
        seen += 1
        if seen == n:
            return


def expect_error(code, call):
    """code: the status the call must end with, or a tuple of those it may end with."""
    with pytest.raises(grpc.RpcError) as info:
        collect(call())
    assert info.value.code() in (code if isinstance(code, tuple) else (code,)), info.value.details()
    return info.value.details()


# ---- correctness -------------------------------------------------------------------------------


def test_greedy_stream_matches_offline(mesh, llm, refs, engine):
    for i, prompt in enumerate(PROMPTS[:2]):
        ref = refs[f"greedy{i}"]
        result = collect(generate(mesh.address, prompt, **GREEDY))
        assert len(result.deltas[0]) > 1  # streamed, not all at once
        assert result.text() == ref.text
        assert result.token_ids[0] == ref.token_ids
        choice = result.choice()
        assert choice.finish_reason == ref.finish_reason
        usage = result.complete.usage
        assert usage.completion_tokens == len(ref.token_ids)
        assert usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
        assert 0 < result.complete.timings.time_to_first_token <= result.complete.timings.e2e_latency
    wait_idle(engine)


def test_32_concurrent_streams_match_offline(mesh, refs, engine):
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: collect(generate(mesh.address, p, **GREEDY)), VARIANTS))
    for i, (prompt, result) in enumerate(zip(VARIANTS, results)):
        assert result.text() == refs[f"greedy{i}"].text, prompt
        assert result.token_ids[0] == refs[f"greedy{i}"].token_ids, prompt
    wait_idle(engine)


def test_chat_matches_offline(mesh, llm, refs):
    ref = refs["chat"]
    tok = llm.tokenizer
    chat_input = tokenizer_pb2.ChatInput(messages=[common_pb2.ChatMessage(**m) for m in CHAT])
    rendered = gateway_stub(mesh.address).Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat_input))
    assert rendered.prompt == tok.apply_chat_template(CHAT)  # the template LLM.chat applies
    result = collect(chat(mesh.address, CHAT, **GREEDY))
    assert result.text() == ref.text
    assert result.token_ids[0] == ref.token_ids


def test_tokenize_and_detokenize_pass_through(mesh, llm):
    gateway = gateway_stub(mesh.address)
    text = "Paged attention keeps KV blocks in a pool. 🚀"
    ids = gateway.Tokenize(tokenizer_pb2.TokenizeRequest(text=text)).token_ids
    assert list(ids) == llm.tokenizer.encode(text)
    assert gateway.Detokenize(tokenizer_pb2.DetokenizeTextRequest(token_ids=ids)).text == text
    with pytest.raises(grpc.RpcError) as info:
        gateway.Detokenize(tokenizer_pb2.DetokenizeTextRequest(token_ids=[-5]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_non_streaming_n2_logprobs_match_offline(mesh, refs):
    """One final message with everything; seeded n=2 draws and logprobs (with their text) as offline."""
    ref = refs["n2"]
    responses = list(generate(mesh.address, PROMPTS[0], stream=False, **N2))
    assert len(responses) == 1 and responses[0].HasField("complete")
    choices = sorted(responses[0].complete.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [r.text for r in ref]
    assert [list(c.token_ids) for c in choices] == [r.token_ids for r in ref]
    for choice, r in zip(choices, ref):
        assert choice.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
        assert len(choice.logprobs) == len(r.logprobs)
        for position, entry in zip(choice.logprobs, r.logprobs):
            assert [e.token_id for e in position.entries] == list(entry)
            assert [e.decoded_token for e in position.entries] == [lp.decoded_token for lp in entry.values()]
            assert position.entries[0].logprob == pytest.approx(next(iter(entry.values())).logprob, abs=1e-4)


def test_stop_string_split_across_tokens(mesh, llm, refs, engine):
    prompt, ref = PROMPTS[2], refs["greedy2"]
    tok = llm.tokenizer
    texts = [tok.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    # A stop string made of the end of one token's text and the start of the next's.
    for i in range(3, len(texts) - 1):
        cut = len(texts[i])
        stop = texts[i + 1][cut - 2 : cut + 2]
        if len(stop) == 4 and stop.strip() == stop and texts[-1].find(stop) == cut - 2:
            break
    else:
        pytest.fail(f"no stop string across tokens found in {ref.text!r}")
    expected = texts[-1][: cut - 2]  # greedy text up to the stop string

    result = collect(generate(mesh.address, prompt, stop=[stop], **LONG))
    # The deltas add up to the text before the stop string: the stop string's first half, streamed with
    # its token before the second half came, was held back and never shown.
    assert len(result.deltas[0]) > 1 and result.text() == expected
    assert result.token_ids[0] == ref.token_ids[: i + 2]  # nothing after the token that completed it
    choice = result.choice()
    assert (choice.finish_reason, choice.stop_str) == ("stop", stop)
    # The engine request ended at the hit, not after 1000 tokens.
    wait_idle(engine)
    # The gateway stopped reading before the engine's final message: the queue time came with the first tokens.
    t = result.complete.timings
    assert 0 < t.queue_time < t.time_to_first_token <= t.e2e_latency


def test_n2_stop_string_ends_only_its_choice(mesh, llm, refs, engine):
    """A stop string in one of two seeded choices ends that choice, and its engine request, alone; the
    other runs to max_tokens, as offline."""
    ref = refs["n2_long"]
    tok = llm.tokenizer
    # A word early in one choice's text that the other's never holds; k: the tokens that complete it.
    hit, stop = next(
        (i, word) for i in (0, 1) for word in ref[i].text.split()[1:6] if len(word) >= 3 and word not in ref[1 - i].text
    )
    k = next(k for k in range(1, N2_LONG["max_tokens"]) if stop in tok.decode(ref[hit].token_ids[:k]))
    assert k <= 16, (stop, k)
    other = 1 - hit

    stream = generate(mesh.address, PROMPTS[2], stop=[stop], **N2_LONG)
    shown = []
    for response in stream:
        shown.append(response)
        if sum(len(d.token_ids) for r in shown for d in r.chunk.choices if d.index == other) >= k + 4:
            break
    # The stopped choice's engine request goes (aborted by then, freed the next step) while the other runs on, or
    # has just run to its end: the engine needs no reader to go on.
    deadline = time.monotonic() + IDLE_WITHIN_S
    while (load := engine.GetLoad(engine_pb2.GetLoadRequest())).num_running == 2:
        assert time.monotonic() < deadline, f"the stopped choice still runs: {load}"
        time.sleep(0.005)
    result = collect(shown + list(stream))

    stopped, full = result.choice(hit), result.choice(other)
    assert (stopped.finish_reason, stopped.stop_str) == ("stop", stop)
    assert result.text(hit) == ref[hit].text[: ref[hit].text.index(stop)]
    assert result.token_ids[hit] == ref[hit].token_ids[:k]
    assert full.finish_reason == "length" and len(result.token_ids[other]) == N2_LONG["max_tokens"]
    assert result.token_ids[other] == ref[other].token_ids and result.text(other) == ref[other].text
    wait_idle(engine)


# ---- cancellation and deadlines -----------------------------------------------------------------


def test_client_cancel_frees_blocks(mesh, engine):
    stream = generate(mesh.address, PROMPTS[1], **LONG)
    first_chunks(stream)
    wait_running(engine)
    stream.cancel()
    wait_idle(engine)


def test_deadline_frees_blocks(mesh, engine):
    errors = []

    def run():
        try:
            # Long enough to start on a busy machine, far shorter than 1000 tokens take.
            collect(generate(mesh.address, PROMPTS[1], timeout=5.0, **LONG))
        except grpc.RpcError as e:
            errors.append(e.code())

    thread = threading.Thread(target=run)
    thread.start()
    wait_running(engine)
    thread.join(60)
    assert errors == [grpc.StatusCode.DEADLINE_EXCEEDED]
    wait_idle(engine)


# ---- bad input ------------------------------------------------------------------------------------


def bad_requests(max_model_len, vocab_size):
    """(what the error message must say, the call)."""
    out_of_vocab = f"is out of vocabulary; token ids must be in [0, {vocab_size})"
    return [
        ("temperature must be non-negative", lambda a: generate(a, "hi", temperature=-1.0)),
        ("top_p must be in (0, 1]", lambda a: generate(a, "hi", top_p=2.0)),
        ("prompt is empty", lambda a: generate(a, "")),
        ("prompt is empty", lambda a: generate(a, [])),
        (
            f"token_ids: the prompt (length {max_model_len}) is longer than the maximum model length",
            lambda a: generate(a, [42] * max_model_len),
        ),
        # Named as the client's field, not the engine's prompt_token_ids.
        (f"token_ids: token id {vocab_size} {out_of_vocab}", lambda a: generate(a, [1, vocab_size, 2])),
        (f"token_ids: token id -1 {out_of_vocab}", lambda a: generate(a, [-1, 1])),
        ("n must be at least 1", lambda a: generate(a, "hi", n=0)),
        ("n must be at most 128 (--max-n)", lambda a: generate(a, "hi", n=129)),
        (
            "sampling_params.bad_words[0] must contain a character other than whitespace",
            lambda a: generate(a, "hi", bad_words=["\n\n"]),
        ),
        ("messages[0].role must be one of", lambda a: chat(a, [{"role": "", "content": "hi"}])),
        (
            "messages[1].role must be one of",
            lambda a: chat(a, [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]),
        ),
        ("messages must hold at least one message", lambda a: chat(a, [])),
        (
            "chat_template: a request may not bring its own chat template here",
            lambda a: gateway_stub(a).Chat(
                gateway_pb2.ChatRequest(
                    messages=[common_pb2.ChatMessage(role="user", content="hi")], chat_template="{{ messages }}"
                )
            ),
        ),
    ]


def test_bad_input_is_invalid_argument_and_others_go_on(mesh, refs, engine):
    card = gateway_stub(mesh.address).ListModels(gateway_pb2.ListModelsRequest()).models[0]
    assert card.id == "smollm2-135m-instruct" and card.max_model_len > 0
    vocab_size = engine.GetModelInfo(engine_pb2.GetModelInfoRequest()).vocab_size
    ref = refs["greedy3"]
    good = generate(mesh.address, PROMPTS[3], **GREEDY)
    shown = [next(good)]  # running while the bad ones come in
    for message, call in bad_requests(card.max_model_len, vocab_size):
        details = expect_error(grpc.StatusCode.INVALID_ARGUMENT, lambda: call(mesh.address))
        assert message in details, (message, details)
    # A model the gateway does not serve is NOT_FOUND.
    details = expect_error(grpc.StatusCode.NOT_FOUND, lambda: generate(mesh.address, "hi", model="gpt-9"))
    assert details == "model 'gpt-9' is not served here; the served model is 'smollm2-135m-instruct'"
    # Admission truncates before it checks the length, as the engine does.
    truncated = collect(generate(mesh.address, [42] * card.max_model_len, truncate_prompt_tokens=8, max_tokens=2))
    assert truncated.complete.usage.prompt_tokens == 8
    result = collect(shown + list(good))
    assert result.text() == ref.text


# ---- admission, keys, drain -----------------------------------------------------------------------


def test_resource_exhausted_unauthenticated_and_drain(mesh, engine, monkeypatch):
    # Also an engine address where nothing listens: the gateway routes around it (it fails its health checks).
    monkeypatch.setenv("LLMMESH_API_KEY", "s3cret")  # a key travels in the environment, never on a command line
    gateway = mesh.start_gateway(
        # A drain long enough for the request in flight below on a busy machine (it ends as soon as that finishes).
        ["--max-requests-in-flight", "1", "--shutdown-timeout", "300", "--engine", "127.0.0.1:1"]
    )
    try:
        address = gateway.address
        details = expect_error(grpc.StatusCode.UNAUTHENTICATED, lambda: generate(address, "hi", max_tokens=2))
        assert "authorization" in details
        expect_error(grpc.StatusCode.UNAUTHENTICATED, lambda: generate(address, "hi", max_tokens=2, api_key="wrong"))

        running = generate(address, PROMPTS[0], api_key="s3cret", **LONG)
        first_chunks(running)
        details = expect_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: generate(address, "hi", max_tokens=2, api_key="s3cret")
        )
        assert "--max-requests-in-flight=1" in details
        running.cancel()
        wait_idle(engine)

        # SIGTERM: the request in flight finishes, new ones get UNAVAILABLE.
        in_flight = generate(address, PROMPTS[0], api_key="s3cret", temperature=0.0, max_tokens=24, ignore_eos=True)
        first_chunks(in_flight, 1)
        # Watched from before the signal: once the drain begins the gateway takes no new calls, Watch included.
        with mesh_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            assert next(watch).status == SERVING
            gateway.terminate()
            assert next(watch).status == NOT_SERVING  # the drain has begun
            watch.cancel()  # an open stream would hold the drain
        # CANCELLED: gRPC's own answer to a call that reaches a server just as it stops taking calls.
        stopping = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        expect_error(stopping, lambda: generate(address, "hi", max_tokens=2, api_key="s3cret"))
        result = collect(in_flight)
        assert result.choice().finish_reason == "length" and result.complete.usage.completion_tokens == 24
        assert gateway.popen.wait(60) == 0
    finally:
        gateway.kill()


# ---- a dependency that dies ---------------------------------------------------------------------


def kill_while_streaming(mesh, engine, service: str) -> list[str]:
    """A long stream per prompt, then `service` killed while they run: each ends with UNAVAILABLE and their blocks
    are freed. Returns each stream's error details."""
    streams = [generate(mesh.address, p, **LONG) for p in PROMPTS]
    for s in streams:
        first_chunks(s)
    wait_running(engine, len(PROMPTS))
    mesh.services[service].kill()
    details = []
    for s in streams:
        with pytest.raises(grpc.RpcError) as info:
            collect(s)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        details.append(info.value.details())
    wait_idle(engine)
    return details


def test_detokenizer_killed_then_restarted(mesh, refs, engine):
    for details in kill_while_streaming(mesh, engine, "detokenizer"):
        # At once, because the stream broke, not after the gateway's wait for a detokenizer answer.
        assert "the detokenizer at" in details and "is unavailable" in details
    # While it is down: UNAVAILABLE, and the gateway's health says so.
    details = expect_error(grpc.StatusCode.UNAVAILABLE, lambda: generate(mesh.address, PROMPTS[0], max_tokens=4))
    assert "detokenizer" in details
    wait_idle(engine)
    wait_for_health(mesh.address, NOT_SERVING)

    mesh.restart("detokenizer")
    wait_for_health(mesh.address, SERVING)
    assert collect(generate(mesh.address, PROMPTS[0], **GREEDY)).text() == refs["greedy0"].text
    wait_idle(engine)


def test_tokenizer_killed_then_restarted(mesh, refs, engine):
    mesh.services["tokenizer"].kill()
    details = expect_error(grpc.StatusCode.UNAVAILABLE, lambda: generate(mesh.address, PROMPTS[0], max_tokens=4))
    assert details.startswith("the tokenizer at") and "is unavailable" in details
    wait_for_health(mesh.address, NOT_SERVING)
    mesh.restart("tokenizer")
    wait_for_health(mesh.address, SERVING)
    assert collect(generate(mesh.address, PROMPTS[0], **GREEDY)).text() == refs["greedy0"].text
    wait_idle(engine)
