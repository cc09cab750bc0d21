"""The engine service as a real process on a loopback port, checked against the offline LLM."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import assert_no_leaks
from engine import LLM, SamplingParams
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.async_engine import AsyncEngine, EngineError

ROOT = Path(__file__).resolve().parent.parent
KV_CACHE_MEMORY = "256MiB"
LISTENING = re.compile(r"llmmesh engine listening on (\S+):(\d+)")


def start_engine(*extra: str) -> tuple[subprocess.Popen, str]:
    """`llmmesh engine --port 0 ...` as a process; returns it and the address from its listening line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "engine", "--port", "0", "--kv-cache-memory", KV_CACHE_MEMORY, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines = []
    # stderr is drained in the background so the process never blocks on a full pipe.
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stderr], daemon=True).start()
    line = proc.stdout.readline()  # blocks until SERVING (or the process dies: "")
    match = LISTENING.search(line)
    if not match:
        proc.kill()
        raise RuntimeError(f"engine did not start: {line!r}\n{''.join(lines[-30:])}")
    return proc, f"{match.group(1)}:{match.group(2)}"


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def engine_address():
    proc, address = start_engine()
    yield address
    stop_engine(proc)


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=KV_CACHE_MEMORY)


@pytest.fixture(scope="module")
def stub(engine_address):
    with grpc.insecure_channel(engine_address) as channel:
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
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def collect(responses) -> dict[int, dict]:
    """index -> {"ids", "final", "messages"} from a Generate stream."""
    out = {}
    for msg in responses:
        entry = out.setdefault(msg.index, {"ids": [], "final": None, "messages": []})
        entry["ids"] += list(msg.token_ids)
        entry["messages"].append(msg)
        if msg.finish_reason:
            assert entry["final"] is None, "a completion finished twice"
            entry["final"] = msg
    return out


async def generate_async(address: str, prompt: list[int], params, request_id: str = "", timeout=None):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = engine_pb2.EngineGenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
        return collect([msg async for msg in stub.Generate(request, timeout=timeout)])


# Abort is applied before the next step; a step takes well under this even on a busy 2-core machine,
# while the requests these tests abandon would otherwise run for minutes.
FREED_WITHIN_S = 2.0


def wait_idle(stub, idle_usage: float, within: float = FREED_WITHIN_S) -> float:
    """Seconds until GetLoad shows no running or waiting request and the idle KV usage; fails after `within`."""
    start = time.monotonic()
    while True:
        load = stub.GetLoad(engine_pb2.GetLoadRequest())
        if load.num_running == 0 and load.num_waiting == 0 and abs(load.kv_cache_usage - idle_usage) < 1e-6:
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"request not freed within {within} s: {load}"
        time.sleep(0.01)


# ---- health, reflection, info ------------------------------------------------------


def test_health_serving_and_reflection(engine_address):
    with grpc.insecure_channel(engine_address) as channel:
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
    load = stub.GetLoad(engine_pb2.GetLoadRequest())
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (0, 0, 0.0)


# ---- correctness against the offline LLM ---------------------------------------------


def test_greedy_single_request_equals_llm(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[0])
    [expected] = reference_ids(llm, [prompt], 16)
    request = engine_pb2.EngineGenerateRequest(request_id="single", prompt_token_ids=prompt, sampling_params=greedy_proto(16))
    result = collect(stub.Generate(request))
    assert list(result) == [0]
    assert result[0]["ids"] == expected
    # One message per step: a single token each (the prompt fits one step).
    assert [len(m.token_ids) for m in result[0]["messages"]] == [1] * 16
    final = result[0]["final"]
    assert final is result[0]["messages"][-1]
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), 16)
    t = final.timings
    assert 0 <= t.queue_time <= t.time_to_first_token <= t.e2e_latency < 60
    # The first tokens' message carries the timings known then (for a caller that stops reading early).
    first = result[0]["messages"][0]
    assert not any(m.HasField("timings") for m in result[0]["messages"][1:-1])
    assert first.timings.queue_time == t.queue_time and first.timings.time_to_first_token == t.time_to_first_token
    assert first.timings.e2e_latency == t.time_to_first_token and not first.HasField("usage")


def test_32_concurrent_greedy_streams_equal_llm(engine_address, llm):
    prompts = prompts_32(llm)
    expected = reference_ids(llm, prompts, 8)

    async def run_all():
        return await asyncio.gather(
            *(generate_async(engine_address, p, greedy_proto(8), f"c{i}") for i, p in enumerate(prompts))
        )

    results = asyncio.run(run_all())
    got = [r[0]["ids"] for r in results]
    wrong = [i for i in range(32) if got[i] != expected[i]]
    assert not wrong, f"streams {wrong} differ from LLM.generate"
    assert all(r[0]["final"].finish_reason == "length" for r in results)
    # Repeated prompt prefixes hit the prefix cache, and the engine says so.
    assert any(r[0]["final"].usage.cached_tokens > 0 for r in results)


def test_stop_token_and_eos(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[1])
    [expected] = reference_ids(llm, [prompt], 12)
    stop_id = expected[5]
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    result = collect(stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=params)))
    cut = expected.index(stop_id) + 1
    assert result[0]["ids"] == expected[:cut]
    final = result[0]["final"]
    assert final.finish_reason == "stop" and final.WhichOneof("stop_reason") == "stop_token_id"
    assert final.stop_token_id == stop_id


def test_n3_seeded_completions_and_logprobs(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[2])
    params = common_pb2.SamplingParams(
        n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    request = engine_pb2.EngineGenerateRequest(request_id="n3", prompt_token_ids=prompt, sampling_params=params)
    first = collect(stub.Generate(request))
    assert sorted(first) == [0, 1, 2]
    ids = [first[i]["ids"] for i in range(3)]
    assert all(len(x) == 8 for x in ids)
    assert len({tuple(x) for x in ids}) > 1, "three seeded samples should not all be the same"
    # The same seed gives the same completions (child i draws with seed + i), as the offline LLM does.
    again = collect(stub.Generate(request))
    assert [again[i]["ids"] for i in range(3)] == ids
    offline = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    assert [list(c.token_ids) for c in offline.outputs] == ids

    for index in range(3):
        messages = first[index]["messages"]
        positions = [p for m in messages for p in m.logprobs]
        assert len(positions) == 8
        for token_id, position, ref in zip(ids[index], positions, offline.outputs[index].logprobs):
            entries = position.entries
            assert entries[0].token_id == token_id and entries[0].decoded_token == ""
            # The chosen token, then the top 2 (the chosen one listed once when it is among them).
            ranks = {1, 2, entries[0].rank}
            assert sorted(e.rank for e in entries) == sorted(ranks)
            assert entries[0].logprob == pytest.approx(ref[token_id].logprob, abs=1e-4)
        assert first[index]["final"].usage.completion_tokens == 8
    # Prompt logprobs come once, for positions 1.., with the first child.
    prompt_positions = [(i, p) for i in range(3) for m in first[i]["messages"] for p in m.prompt_logprobs]
    assert len(prompt_positions) == len(prompt) - 1 and {i for i, _ in prompt_positions} == {0}
    assert [p.entries[0].token_id for _, p in prompt_positions] == prompt[1:]


def test_n_children_share_the_prompt_blocks(stub, llm):
    # A prompt no request has used: child 1 can only hit blocks that child 0 holds (2 full blocks of 16).
    prompt = llm.tokenizer.encode("Shared prompt blocks: " + "one two three four five " * 8)[:40]
    params = common_pb2.SamplingParams(n=2, temperature=0.0, max_tokens=2, ignore_eos=True)
    result = collect(stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=params)))
    cached = {i: result[i]["final"].usage.cached_tokens for i in result}
    assert cached == {0: 0, 1: 32}
    assert result[0]["ids"] == result[1]["ids"]  # greedy children agree


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
    call = stub.Generate(long_request("deadline", llm), timeout=2.0)
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
    got += list(call)  # the stream ends on its own
    final = got[-1]
    assert final.finish_reason == "abort" and all(not m.finish_reason for m in got[:-1])
    assert final.usage.completion_tokens == sum(len(m.token_ids) for m in got) < 2000
    assert stub.Abort(engine_pb2.AbortRequest(request_ids=["abort-me"])).num_aborted == 0
    wait_idle(stub, 0.0)


def test_abort_rpc_with_a_child_id_ends_that_child_alone(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[3])
    [expected] = reference_ids(llm, [prompt], 48)
    request = engine_pb2.EngineGenerateRequest(request_id="pair", prompt_token_ids=prompt, sampling_params=greedy_proto(48, n=2))
    call = stub.Generate(request)
    got = [next(call)]
    # Child 1 of "pair" (engine/output_processor.child_request_id) by its engine request id.
    assert stub.Abort(engine_pb2.AbortRequest(request_ids=["1_pair"])).num_aborted == 1
    result = collect([*got, *call])
    assert result[1]["final"].finish_reason == "abort" and len(result[1]["ids"]) < 48
    assert result[0]["final"].finish_reason == "length" and result[0]["ids"] == expected
    wait_idle(stub, 0.0)


# ---- bad input ---------------------------------------------------------------------------


BAD_REQUESTS = [
    ("temperature", dict(sampling_params=common_pb2.SamplingParams(temperature=-0.5))),
    ("top_p", dict(sampling_params=common_pb2.SamplingParams(top_p=2.0))),
    ("prompt_token_ids", dict(prompt_token_ids=[])),
    ("prompt_token_ids", dict(prompt_token_ids=[1] * 9000)),  # longer than max_model_len (8192)
    ("prompt_token_ids", dict(prompt_token_ids=[1, 10**6])),  # outside the vocabulary
    ("n", dict(sampling_params=common_pb2.SamplingParams(n=0))),
    ("n", dict(sampling_params=common_pb2.SamplingParams(n=10**9))),  # more than --max-num-seqs
    ("logprobs", dict(sampling_params=common_pb2.SamplingParams(logprobs=21))),
    ("request_id", dict(request_id="busy")),  # a running request's id
]


def test_bad_input_is_invalid_argument_while_another_stream_runs(stub, llm):
    prompt = llm.tokenizer.encode(PROMPTS[0])
    [expected] = reference_ids(llm, [prompt], 24)
    good = stub.Generate(engine_pb2.EngineGenerateRequest(request_id="busy", prompt_token_ids=prompt, sampling_params=greedy_proto(24)))
    first = next(good)
    for field, fields in BAD_REQUESTS:
        request = engine_pb2.EngineGenerateRequest(**{"prompt_token_ids": [1, 2, 3], **fields})
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        # The message starts with the field's name, then says what is allowed.
        assert re.match(rf"{field}\b", err.value.details()), (field, err.value.details())
    rest = collect([first, *good])
    assert rest[0]["ids"] == expected and rest[0]["final"].finish_reason == "length"
    wait_idle(stub, 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_not_serving_while_loading_then_sigterm_drains(llm):
    """A second process: health NOT_SERVING (and RPCs UNAVAILABLE) until the model is loaded; on SIGTERM
    new requests get UNAVAILABLE while the one in flight finishes, and the process exits cleanly."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "engine", "--port", str(port), "--kv-cache-memory", KV_CACHE_MEMORY],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        seen = set()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = engine_pb2_grpc.EngineStub(channel)
            deadline = time.monotonic() + 120
            while "SERVING" not in seen:
                assert time.monotonic() < deadline and proc.poll() is None, seen
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service="llmmesh.v1.Engine"), timeout=1).status
                except grpc.RpcError:
                    time.sleep(0.02)  # not listening yet
                    continue
                seen.add(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    try:
                        stub.GetLoad(engine_pb2.GetLoadRequest())
                    except grpc.RpcError as e:
                        seen.add(e.code().name)
            assert {"NOT_SERVING", "UNAVAILABLE", "SERVING"} <= seen
            assert "listening on 127.0.0.1:%d" % port in proc.stdout.readline()

            prompt = llm.tokenizer.encode(PROMPTS[0])
            [expected] = reference_ids(llm, [prompt], 16)
            call = stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=greedy_proto(16)))
            first = next(call)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=greedy_proto(4))))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert collect([first, *call])[0]["ids"] == expected
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the engine thread on its own (in-process, sharing the reference LLM's EngineCore) ----------


def test_engine_thread_survives_failing_requests(llm, monkeypatch):
    """An add that raises in the engine thread, and a step that raises, each fail only their own
    request; the thread goes on serving and nothing leaks."""
    core = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[1])
    [expected] = reference_ids(llm, [prompt], 12)
    real_add, real_execute = core.add_request, core.model_runner.execute_model

    def add(request):
        if request.request_id == "poison":
            raise RuntimeError("poisoned add")
        real_add(request)

    def execute(scheduler_output):
        step_threads.add(threading.get_ident())
        if any(r.request_id == "explode" for r in scheduler_output.scheduled_requests):
            raise RuntimeError("exploding step")
        return real_execute(scheduler_output)

    monkeypatch.setattr(core, "add_request", add)
    monkeypatch.setattr(core.model_runner, "execute_model", execute)
    step_threads = set()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def drain(stream):
        return [out async for _, outs in stream for out in outs]

    async def scenario():
        built_on = []
        # Built and stepped on the engine thread alone, so torch's OpenMP pool is only that thread's.
        engine = AsyncEngine(lambda: built_on.append(threading.get_ident()) or core)
        assert await engine.loaded() is core and built_on == [engine.thread.ident]
        try:
            good = engine.add_request("good", prompt, greedy.clone())
            bad = engine.add_request("poison", prompt, greedy.clone())
            good_outs, bad_outs = await asyncio.gather(drain(good), drain(bad))
            assert [type(o) for o in bad_outs] == [EngineError] and "poisoned add" in bad_outs[0].message
            assert [t for o in good_outs for t in o.new_token_ids] == expected

            boom = await drain(engine.add_request("explode", prompt, greedy.clone()))
            assert [type(o) for o in boom] == [EngineError] and "exploding step" in boom[0].message
            after = await drain(engine.add_request("after", prompt, greedy.clone()))
            assert [t for o in after for t in o.new_token_ids] == expected
            assert engine.thread.is_alive() and not engine.streams and not engine.requests
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
