"""The engine service (llmmesh.v1.Engine) served in-process on a loopback port, checked against the offline
LLM; as a real process where SIGTERM is the point."""

import asyncio
import re
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import (
    NOT_SERVING,
    SERVING,
    InProcessService,
    aio_mesh_channel,
    assert_no_leaks,
    mesh_channel,
    undecodable,
)
from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM, EngineRequestError
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.service_process import ServiceProcess

KV_CACHE_MEMORY = "256MiB"


@pytest.fixture(scope="module")
def engine_address():
    with InProcessService("engine", ["--kv-cache-memory", KV_CACHE_MEMORY, "--shutdown-timeout", "5"]) as engine:
        yield engine.address


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=KV_CACHE_MEMORY)


@pytest.fixture(scope="module")
def stub(engine_address):
    with mesh_channel(engine_address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def prompts_32(llm) -> list[list[int]]:
    tok = llm.tokenizer
    # A shared first block, so the prefix cache has something to hit.
    preamble = "Answer in one short sentence, plainly and without any preamble or apology, as a careful expert would. "
    return [tok.encode(f"{preamble}{PROMPTS[i % 4]} {word}") for i, word in enumerate(("A B C D E F G H".split()) * 4)]


def greedy_proto(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def reference_ids(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [
        list(o.outputs[0].token_ids)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


@dataclass
class Completion:
    ids: list[int] = field(default_factory=list)
    deltas: list = field(default_factory=list)  # its CompletionDelta of each message that moved it
    final: object = None  # the delta with its finish_reason


@dataclass
class Generation:
    """A Generate stream: every message (one per engine step) and each completion's deltas."""

    messages: list = field(default_factory=list)
    completions: dict[int, Completion] = field(default_factory=dict)

    def __getitem__(self, index: int) -> Completion:
        return self.completions[index]

    @property
    def last(self):
        return self.messages[-1]


def collect(responses) -> Generation:
    out = Generation()
    for msg in responses:
        out.messages.append(msg)
        assert len({d.index for d in msg.outputs}) == len(msg.outputs), "a completion twice in one message"
        for d in msg.outputs:
            c = out.completions.setdefault(d.index, Completion())
            assert c.final is None, "a completion moved after it finished"
            c.ids += list(d.token_ids)
            c.deltas.append(d)
            if d.finish_reason:
                c.final = d
    if out.messages:  # usage comes once, on the last message, when every completion has finished
        assert all(c.final is not None for c in out.completions.values()) == out.last.HasField("usage")
        assert not any(m.HasField("usage") for m in out.messages[:-1])
    return out


async def generate_async(address: str, prompt: list[int], params, request_id: str = "", timeout=None) -> Generation:
    async with aio_mesh_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = engine_pb2.EngineGenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=params
        )
        return collect([msg async for msg in stub.Generate(request, timeout=timeout)])


# Abort is applied before the next step, so the blocks come back within a few steps; a request abandoned
# here would otherwise run for 2000 tokens (minutes on a CPU). This only bounds the wait: no speed is asserted.
FREED_WITHIN_S = 30.0


def wait_idle(stub, idle_usage: float, within: float = FREED_WITHIN_S) -> None:
    """Wait until GetLoad shows no running or waiting request and the idle KV usage (the engine publishes
    its load after every step and offers no event for it, so this polls); fails after `within`."""
    deadline = time.monotonic() + within
    while True:
        load = stub.GetLoad(engine_pb2.GetLoadRequest())
        if load.num_running == 0 and load.num_waiting == 0 and abs(load.kv_cache_usage - idle_usage) < 1e-6:
            return
        assert time.monotonic() < deadline, f"request not freed within {within} s: {load}"
        time.sleep(0.01)


# ---- health, reflection, info ------------------------------------------------------


def test_health_serving_and_reflection(engine_address):
    with mesh_channel(engine_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "llmmesh.v1.Engine"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"llmmesh.v1.Engine", "grpc.health.v1.Health"} <= names


def test_model_server_info_and_idle_load(stub, llm):
    model = stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert model.model == "smollm2-135m-instruct" and model.architecture == "LlamaForCausalLM"
    assert model.vocab_size == llm.engine.model_config.vocab_size
    assert model.max_model_len == llm.engine.max_model_len
    assert list(model.eos_token_ids) == llm.engine.model_config.eos_token_ids
    server = stub.GetServerInfo(engine_pb2.GetServerInfoRequest())
    assert server.num_gpu_blocks == llm.engine.num_blocks and server.block_size == 16
    assert server.max_logprobs == 20
    assert server.max_num_batched_tokens == 512  # unset, on a CPU
    load = stub.GetLoad(engine_pb2.GetLoadRequest())
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (0, 0, 0.0)


# ---- correctness against the offline LLM ---------------------------------------------


def test_greedy_single_request_equals_llm(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[0])
    [expected] = reference_ids(llm, [prompt], 16)
    request = engine_pb2.EngineGenerateRequest(
        request_id="single", prompt_token_ids=prompt, sampling_params=greedy_proto(16)
    )
    result = collect(stub.Generate(request))
    assert list(result.completions) == [0]
    assert result[0].ids == expected
    # One message per step, with the one completion's single new token (the prompt fits one step).
    assert [[len(d.token_ids) for d in m.outputs] for m in result.messages] == [[1]] * 16
    final = result[0].final
    assert final is result.last.outputs[0]
    assert final.finish_reason == "length" and final.WhichOneof("stop_reason") is None
    usage = result.last.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 16)
    t = result.last.timings
    assert 0 <= t.queue_time <= t.time_to_first_token <= t.e2e_latency < 60
    # The first tokens' message carries the timings known then (for a caller that stops reading early),
    # and the prompt's length.
    first = result.messages[0]
    assert not any(m.HasField("timings") for m in result.messages[1:-1])
    assert first.timings.queue_time == t.queue_time and first.timings.time_to_first_token == t.time_to_first_token
    assert t.time_to_first_token <= first.timings.e2e_latency <= t.e2e_latency and not first.HasField("usage")
    assert first.num_prompt_tokens == len(prompt) and not any(m.num_prompt_tokens for m in result.messages[1:])


def test_32_concurrent_greedy_streams_equal_llm(engine_address, llm):
    prompts = prompts_32(llm)
    expected = reference_ids(llm, prompts, 8)

    async def run_all():
        return await asyncio.gather(
            *(generate_async(engine_address, p, greedy_proto(8), f"c{i}") for i, p in enumerate(prompts))
        )

    results = asyncio.run(run_all())
    got = [r[0].ids for r in results]
    wrong = [i for i in range(32) if got[i] != expected[i]]
    assert not wrong, f"streams {wrong} differ from LLM.generate"
    assert all(r[0].final.finish_reason == "length" for r in results)
    # Repeated prompt prefixes hit the prefix cache, and the engine says so.
    assert any(r.last.usage.cached_tokens > 0 for r in results)


def test_stop_token_and_eos(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[1])
    [expected] = reference_ids(llm, [prompt], 12)
    stop_id = expected[5]
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    result = collect(stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=params)))
    cut = expected.index(stop_id) + 1
    assert result[0].ids == expected[:cut]
    final = result[0].final
    assert final.finish_reason == "stop" and final.WhichOneof("stop_reason") == "stop_token_id"
    assert final.stop_token_id == stop_id


def stop_string_case(llm, prompt, max_tokens):
    """Two words from the middle of the greedy text (more than one token): a stop string the request must end at."""
    full = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    stop = " ".join(full.text.split()[2:4])
    assert len(llm.tokenizer.encode(stop, add_special_tokens=False)) > 1 and full.text.index(stop) > 0
    return stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_request_as_offline(stub, llm, include):
    """llmmesh.v1.Engine honours stop strings: the same tokens and finish as LLM.generate with the same stop,
    and the engine request ends at the hit (the gateway leaves stop strings to the detokenizer, other callers
    need not)."""
    prompt = llm.tokenizer.encode(PROMPTS[2])
    stop = stop_string_case(llm, prompt, 32)
    kwargs = dict(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
    expected = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kwargs), use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop" and expected.stop_reason == stop and len(expected.token_ids) < 32

    request = engine_pb2.EngineGenerateRequest(
        prompt_token_ids=prompt, sampling_params=common_pb2.SamplingParams(**kwargs)
    )
    result = collect(stub.Generate(request))
    assert result[0].ids == list(expected.token_ids)
    final = result[0].final
    assert (final.finish_reason, final.WhichOneof("stop_reason"), final.stop_str) == ("stop", "stop_str", stop)
    # The same text: the tokens' text holds the offline text, then the stop string (which the offline text
    # shows only with include_stop_str_in_output).
    text = llm.tokenizer.decode(result[0].ids)
    assert text.startswith(expected.text if include else expected.text + stop)
    assert result.last.usage.completion_tokens == len(expected.token_ids)
    wait_idle(stub, 0.0)


def test_n3_seeded_completions_and_logprobs(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[2])
    params = common_pb2.SamplingParams(
        n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    request = engine_pb2.EngineGenerateRequest(request_id="n3", prompt_token_ids=prompt, sampling_params=params)
    first = collect(stub.Generate(request))
    assert sorted(first.completions) == [0, 1, 2]
    ids = [first[i].ids for i in range(3)]
    assert all(len(x) == 8 for x in ids)
    assert len({tuple(x) for x in ids}) > 1, "three seeded samples should not all be the same"
    # One message per engine step, holding every completion that moved in it: the three step together.
    assert [sorted(d.index for d in m.outputs) for m in first.messages] == [[0, 1, 2]] * 8
    # The same seed gives the same completions (child i draws with seed + i), as the offline LLM does.
    again = collect(stub.Generate(request))
    assert [again[i].ids for i in range(3)] == ids
    offline = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    assert [list(c.token_ids) for c in offline.outputs] == ids

    for index in range(3):
        positions = [p for d in first[index].deltas for p in d.logprobs]
        assert len(positions) == 8
        for token_id, position, ref in zip(ids[index], positions, offline.outputs[index].logprobs):
            entries = position.entries
            assert entries[0].token_id == token_id and entries[0].decoded_token == ""
            # The chosen token, then the top 2 (the chosen one listed once when it is among them).
            ranks = {1, 2, entries[0].rank}
            assert sorted(e.rank for e in entries) == sorted(ranks)
            assert entries[0].logprob == pytest.approx(ref[token_id].logprob, abs=1e-4)
    assert first.last.usage.completion_tokens == 3 * 8
    # Prompt logprobs come once, for positions 1.., with the first tokens.
    prompt_positions = [(i, p) for i, m in enumerate(first.messages) for p in m.prompt_logprobs]
    assert len(prompt_positions) == len(prompt) - 1 and {i for i, _ in prompt_positions} == {0}
    assert [p.entries[0].token_id for _, p in prompt_positions] == prompt[1:]


def test_n_children_share_the_prompt_blocks(stub, llm):
    # A prompt no request has used: its cached blocks can only be the ones the first child holds (2 full blocks of 16).
    prompt = llm.tokenizer.encode("Shared prompt blocks: " + "one two three four five " * 8)[:40]
    params = common_pb2.SamplingParams(n=2, temperature=0.0, max_tokens=2, ignore_eos=True)
    result = collect(stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=params)))
    assert result.last.usage.cached_tokens == 32
    assert result[0].ids == result[1].ids  # greedy children agree


# ---- cancellation, deadlines, abort ----------------------------------------------------


def long_request(request_id: str, llm) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id=request_id, prompt_token_ids=llm.tokenizer.encode(PROMPTS[3]), sampling_params=greedy_proto(2000)
    )


def test_client_cancel_frees_blocks(stub, llm):
    call = stub.Generate(long_request("cancel-me", llm))
    for _ in range(3):
        next(call)
    load = stub.GetLoad(engine_pb2.GetLoadRequest())
    assert load.num_running == 1 and load.kv_cache_usage > 0
    call.cancel()
    wait_idle(stub, 0.0)


def test_expired_deadline_frees_blocks(stub, llm):
    # Long enough for the first tokens on a busy machine, far shorter than 2000 tokens take.
    call = stub.Generate(long_request("deadline", llm), timeout=5.0)
    received = []
    with pytest.raises(grpc.RpcError) as err:
        for msg in call:
            received.append(msg)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received, "the request should have been running when its deadline passed"
    wait_idle(stub, 0.0)


def test_abort_rpc_ends_stream_with_abort(stub, llm):
    call = stub.Generate(long_request("abort-me", llm))
    got = [next(call)]
    assert stub.Abort(engine_pb2.AbortRequest(request_ids=["abort-me", "no-such-request"])).num_aborted == 1
    result = collect([*got, *call])  # the stream ends on its own
    final = result[0].final
    assert final is result.last.outputs[0] and final.finish_reason == "abort"
    assert result.last.usage.completion_tokens == len(result[0].ids) < 2000
    assert stub.Abort(engine_pb2.AbortRequest(request_ids=["abort-me"])).num_aborted == 0
    wait_idle(stub, 0.0)


def test_abort_rpc_with_a_child_id_ends_that_child_alone(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[3])
    [expected] = reference_ids(llm, [prompt], 48)
    request = engine_pb2.EngineGenerateRequest(
        request_id="pair", prompt_token_ids=prompt, sampling_params=greedy_proto(48, n=2)
    )
    call = stub.Generate(request)
    got = [next(call)]
    # Child 1 of "pair" (engine/output_processor.child_request_id) by its engine request id.
    assert stub.Abort(engine_pb2.AbortRequest(request_ids=["1_pair"])).num_aborted == 1
    result = collect([*got, *call])
    assert result[1].final.finish_reason == "abort" and len(result[1].ids) < 48
    assert result[0].final.finish_reason == "length" and result[0].ids == expected
    wait_idle(stub, 0.0)


# ---- bad input ---------------------------------------------------------------------------


BAD_REQUESTS = [
    ("temperature", dict(sampling_params=common_pb2.SamplingParams(temperature=-0.5))),
    ("top_p", dict(sampling_params=common_pb2.SamplingParams(top_p=2.0))),
    ("prompt_token_ids", dict(prompt_token_ids=[])),
    ("prompt_token_ids", dict(prompt_token_ids=[1] * 9000)),  # longer than max_model_len (8192)
    ("prompt_token_ids", dict(prompt_token_ids=[1, 10**6])),  # outside the vocabulary
    ("n", dict(sampling_params=common_pb2.SamplingParams(n=0))),
    ("n", dict(sampling_params=common_pb2.SamplingParams(n=10**9))),  # more than --max-n
    ("logprobs", dict(sampling_params=common_pb2.SamplingParams(logprobs=21))),
    ("stop", dict(sampling_params=common_pb2.SamplingParams(stop=["x"] * 65))),  # more than --max-stop
    ("request_id", dict(request_id="busy")),  # a running request's id
    ("request_id", dict(request_id="r" * 257)),  # longer than --max-id-chars
]


def test_bad_input_is_invalid_argument_while_another_stream_runs(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[0])
    [expected] = reference_ids(llm, [prompt], 24)
    good = stub.Generate(
        engine_pb2.EngineGenerateRequest(request_id="busy", prompt_token_ids=prompt, sampling_params=greedy_proto(24))
    )
    first = next(good)
    for field_name, fields in BAD_REQUESTS:
        request = engine_pb2.EngineGenerateRequest(**{"prompt_token_ids": [1, 2, 3], **fields})
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field_name
        # The message starts with the field's name, then says what is allowed.
        assert re.match(rf"{field_name}\b", err.value.details()), (field_name, err.value.details())
    rest = collect([first, *good])
    assert rest[0].ids == expected and rest[0].final.finish_reason == "length"
    wait_idle(stub, 0.0)


def test_undecodable_request_is_invalid_argument_and_the_server_goes_on(engine_address, stub, llm):
    data = undecodable(engine_pb2.EngineGenerateRequest)
    with mesh_channel(engine_address) as channel:
        generate = channel.unary_stream(
            "/llmmesh.v1.Engine/Generate", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as err:
            list(generate(data))
        abort = channel.unary_unary("/llmmesh.v1.Engine/Abort", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as abort_err:
            abort(undecodable(engine_pb2.AbortRequest))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not decode" in err.value.details()
    assert abort_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    prompt = llm.tokenizer.encode(PROMPTS[0])
    [expected] = reference_ids(llm, [prompt], 4)
    request = engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=greedy_proto(4))
    assert collect(stub.Generate(request))[0].ids == expected


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_not_serving_while_loading_then_sigterm_drains(llm):
    """A real process: health NOT_SERVING (and RPCs UNAVAILABLE) until the model is loaded; on SIGTERM
    new requests get UNAVAILABLE while the one in flight finishes, and the process exits cleanly."""
    port = free_port()  # known before the process listens, so its health can be watched while it loads
    proc = ServiceProcess("engine", ["--port", str(port), "--kv-cache-memory", KV_CACHE_MEMORY])
    try:
        # Retried every 100 ms while the process starts: gRPC's default reconnect backoff grows to seconds, and the
        # watch could then first connect after the model had loaded. (Not min_reconnect_backoff_ms: gRPC takes it for
        # the time a connection attempt gets, which a TLS handshake with a loading process can need more of.)
        fast_retry = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 100)]
        with mesh_channel(f"127.0.0.1:{port}", options=fast_retry, server="engine") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            # Health.Watch waits for the server to listen, then sends every change of its status.
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="llmmesh.v1.Engine"), timeout=300, wait_for_ready=True
            )
            assert next(watch).status == NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                stub.GetLoad(engine_pb2.GetLoadRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            assert next(watch).status == SERVING
            assert proc.wait_listening(60) == f"127.0.0.1:{port}"

            prompt = llm.tokenizer.encode(PROMPTS[0])
            [expected] = reference_ids(llm, [prompt], 16)
            call = stub.Generate(
                engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=greedy_proto(16))
            )
            first = next(call)
            proc.terminate()
            # NOT_SERVING is set as the drain starts, just before the server stops taking calls.
            assert next(watch).status == NOT_SERVING
            watch.cancel()  # a call in flight too: the drain would wait for it
            with pytest.raises(grpc.RpcError) as err:
                list(
                    stub.Generate(
                        engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=greedy_proto(4))
                    )
                )
            # CANCELLED: gRPC's own answer to a call that reaches a server just as it stops taking calls.
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert collect([first, *call])[0].ids == expected
        assert proc.popen.wait(timeout=30) == 0
    finally:
        if proc.alive():
            proc.kill()


# ---- the engine thread on its own (in-process, sharing the reference LLM's EngineCore) ----------


async def drain(stream) -> tuple[list[int], EngineRequestError | None]:
    """A request's tokens (one completion), and the error that ended it, if any."""
    tokens = []
    try:
        async for out in stream:
            tokens += [t for c in out.outputs for t in c.token_ids]
    except EngineRequestError as e:
        return tokens, e
    return tokens, None


def test_engine_thread_survives_failing_requests(llm, monkeypatch):
    """An add that raises in the engine thread, and a step that raises, each fail only their own
    request; the thread goes on serving and nothing leaks."""
    core = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[1])
    [expected] = reference_ids(llm, [prompt], 12)
    real_add, real_execute = core.add_request, core.worker.execute_model

    def add(request):
        if request.request_id == "poison":
            raise RuntimeError("poisoned add")
        real_add(request)

    def execute(scheduler_output, while_sampling=None):
        step_threads.add(threading.get_ident())
        if any(r.request_id == "explode" for r in scheduler_output.scheduled_requests):
            raise RuntimeError("exploding step")
        return real_execute(scheduler_output, while_sampling)

    monkeypatch.setattr(core, "add_request", add)
    monkeypatch.setattr(core.worker, "execute_model", execute)
    step_threads = set()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def scenario():
        built_on = []
        # Built and stepped on the engine thread alone, so torch's OpenMP pool is only that thread's.
        engine = AsyncLLM(lambda: built_on.append(threading.get_ident()) or core)
        assert await engine.loaded() is core and built_on == [engine.thread.ident]
        engine.set_tokenizer(llm.tokenizer)
        try:
            good = engine.add_request("good", prompt, greedy.clone())
            bad = engine.add_request("poison", prompt, greedy.clone())
            (good_tokens, good_error), (bad_tokens, bad_error) = await asyncio.gather(drain(good), drain(bad))
            assert bad_tokens == [] and "poisoned add" in str(bad_error)
            assert good_tokens == expected and good_error is None

            boom_tokens, boom_error = await drain(engine.add_request("explode", prompt, greedy.clone()))
            assert boom_tokens == [] and "exploding step" in str(boom_error)
            assert await drain(engine.add_request("after", prompt, greedy.clone())) == (expected, None)
            assert engine.thread.is_alive() and engine.dead is None and not engine.died.is_set()
            assert not engine.streams and not engine.output_processor.has_unfinished_requests()
            # Refused on the caller's side, before anything reaches the engine thread.
            with pytest.raises(ValueError, match="prompt_token_ids"):
                engine.add_request("empty", [], greedy.clone())
            running = engine.add_request("dup", prompt, greedy.clone())
            with pytest.raises(ValueError, match="request_id 'dup'"):
                engine.add_request("dup", prompt, greedy.clone())
            await drain(running)
        finally:
            engine.shutdown()
        assert not engine.thread.is_alive()
        assert step_threads == set(built_on)

    asyncio.run(scenario())
    assert_no_leaks(core)
