"""Bounded clients: per-tenant rate limits (token buckets) at the gateway, its in-flight limit over every call, the
engine's waiting queue, the sampler's streams and per-stream state, and every server's concurrent calls. Each
refusal is RESOURCE_EXHAUSTED naming its limit; a rate limit's also says when to retry (the message and the
trailing metadata's retry-after). A tiny random model served in-process on loopback; no timing is asserted."""

import hashlib
import json
import random
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_tenants import small_mesh

from conftest import InProcessService, mesh_channel
from llmmesh.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    sampler_pb2,
    sampler_pb2_grpc,
    tokenizer_pb2,
)
from mesh.sampler.wire import tensor_to_proto
from random_model import save_random_smollm2_shaped
from services import client
from services.tenants import TokenBucket
from test_models import COMMON

KEYS = {"slow": "slow-key", "thrifty": "thrifty-key", "free": "free-key"}
LIMITS = {"slow": {"requests_per_second": 2}, "thrifty": {"tokens_per_minute": 120}, "free": {}}
MAX_MODEL_LEN = 2048
LONG = MAX_MODEL_LEN - 8  # tokens a request generates: seconds, long enough to be caught running


def auth(tenant: str):
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def prompt(seed: int, length: int = 40) -> list[int]:
    return random.Random(seed).choices(range(3, COMMON["vocab_size"]), k=length)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    return e.value


# ---- token buckets -------------------------------------------------------------------------------------


def test_token_bucket_spends_refills_and_says_when():
    now = [0.0]
    bucket = TokenBucket(rate=2.0, capacity=4.0, clock=lambda: now[0])
    assert [bucket.take(1) for _ in range(4)] == [0.0] * 4
    assert bucket.take(1) == pytest.approx(0.5)  # one unit at 2 a second
    assert bucket.take(5) == float("inf")  # over the capacity: never
    now[0] = 1.0
    assert bucket.take(2) == 0.0 and bucket.take(1) == pytest.approx(0.5)
    bucket.charge(3)  # after the fact: a debt the next takes wait for
    assert bucket.take(1) == pytest.approx(2.0)
    now[0] = 100.0
    assert bucket.take(4) == 0.0  # refilled to its capacity, no more


# ---- the gateway ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    save_random_smollm2_shaped(root / "base", **{**COMMON, "max_position_embeddings": MAX_MODEL_LEN})
    return root


@pytest.fixture(scope="module")
def mesh(model_dir):
    keys = [{"sha256": hashlib.sha256(KEYS[t].encode()).hexdigest(), "tenant": t, **LIMITS[t]} for t in sorted(KEYS)]
    (model_dir / "keys.json").write_text(json.dumps({"keys": keys}))
    model = ["--model", str(model_dir / "base"), "--shutdown-timeout", "5"]
    # One request runs, one waits: a third is refused (--max-waiting-requests).
    engine = [*model, "--kv-cache-memory", "16MiB", "--max-num-seqs", "1", "--max-waiting-requests", "1"]
    gateway = ["--api-keys-file", str(model_dir / "keys.json"), "--max-requests-in-flight", "1"]
    with small_mesh(model, engine, gateway) as services:
        yield services


@pytest.fixture(scope="module")
def gateway(mesh):
    with mesh_channel(mesh["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def generate(gateway, tenant: str, tokens, max_tokens: int = 2):
    request = gateway_pb2.GenerateRequest(stream=True, sampling_params=client.sampling_params(max_tokens=max_tokens))
    request.token_ids.ids.extend(tokens)
    return gateway.Generate(request, metadata=auth(tenant), timeout=60)


def retry_after(error: grpc.RpcError) -> float:
    seconds = float(dict(error.trailing_metadata())["retry-after"])
    assert f"retry after {seconds:.3f} s" in error.details()
    return seconds


def calls(gateway, tenant: str) -> list:
    """One call of each kind but Generate's, as that tenant."""
    metadata = auth(tenant)
    return [
        lambda: gateway.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"), metadata=metadata, timeout=10),
        lambda: gateway.Detokenize(tokenizer_pb2.DetokenizeTextRequest(token_ids=[5]), metadata=metadata, timeout=10),
        lambda: gateway.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=10),
    ]


def test_requests_per_second_hold_for_every_call(gateway):
    """Generate, Tokenize, Detokenize and ListModels draw on one bucket: 2 a second, 2 at most at once."""
    generate_once = [lambda: client.collect(generate(gateway, "slow", prompt(1)))]
    tokenize, detokenize, list_models = calls(gateway, "slow")
    generate_once[0]()
    # Cheap calls until one is refused: the bucket is empty then, however much it refilled while the Generate ran.
    for _ in range(3):
        try:
            tokenize()
        except grpc.RpcError:
            break
    else:
        pytest.fail("three Tokenize calls after a Generate and none refused, from a bucket that holds 2")
    for call in [*generate_once, tokenize, detokenize, list_models]:  # every kind is refused until it refills
        error = refused(call)
        assert "tenant 'slow'" in error.details() and "requests_per_second (2)" in error.details()
    wait = retry_after(error)
    assert 0 < wait <= 0.5
    time.sleep(wait)
    list_models()
    refused(detokenize)
    for call in calls(gateway, "free") * 3:  # another tenant's bucket is its own (and "free" has none)
        call()


def test_tokens_per_minute_count_prompts_and_completions(gateway):
    """120 a minute: a 40-token prompt and 40 generated, then another 40-token prompt; a fourth prompt waits for the
    bucket to refill (2 a second); a prompt over the whole minute's never fits."""
    client.collect(generate(gateway, "thrifty", prompt(2), max_tokens=40))
    client.collect(generate(gateway, "thrifty", prompt(3), max_tokens=1))
    error = refused(lambda: client.collect(generate(gateway, "thrifty", prompt(4))))
    assert "tokens_per_minute (120)" in error.details()
    assert retry_after(error) > 0
    error = refused(lambda: client.collect(generate(gateway, "thrifty", prompt(5, length=121))))
    assert "never fits" in error.details() and "retry-after" not in dict(error.trailing_metadata())


def test_the_in_flight_limit_covers_tokenize_detokenize_and_list_models(gateway, mesh):
    running = generate(gateway, "free", prompt(6, 8), max_tokens=LONG)
    next(running)  # in flight
    try:
        for call in calls(gateway, "free"):
            assert "--max-requests-in-flight=1" in refused(call).details()
    finally:
        running.cancel()


# ---- the engine's waiting queue ---------------------------------------------------------------------------


def test_the_engine_waiting_queue_is_bounded(mesh):
    params = client.sampling_params(max_tokens=LONG, ignore_eos=True)
    with mesh_channel(mesh["engine"].address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)

        def call(i):
            request = engine_pb2.EngineGenerateRequest(
                request_id=f"q{i}", prompt_token_ids=prompt(10 + i, 8), sampling_params=params
            )
            return stub.Generate(request, timeout=60)

        running = call(0)
        next(running)  # running: --max-num-seqs 1
        waiting = call(1)  # its first message comes once the running one ends
        try:
            deadline = time.monotonic() + 30
            while len(mesh["engine"].server.servicers[0].engine.streams) < 2:
                assert time.monotonic() < deadline, "the second request never reached the engine"
                time.sleep(0.01)
            error = refused(lambda: next(call(2)))
            assert "--max-waiting-requests (1)" in error.details() and "--max-num-seqs (1)" in error.details()
        finally:
            running.cancel()
            waiting.cancel()


# ---- the sampler and every server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampler():
    with InProcessService(
        "sampler",
        [
            "--max-streams",
            "1",
            "--max-requests-per-stream",
            "2",
            "--max-tokens-per-stream",
            "12",
            "--max-concurrent-rpcs",
            "2",
        ],
    ) as service:
        yield service


def step(
    step_id: int, request_ids: list[str], new=None, prompt=(), new_tokens=(), finished=()
) -> sampler_pb2.SampleStep:
    """A step of the rows request_ids, the new ones (default: all) with prompt, each with new_tokens of output."""
    params = sampler_pb2.SamplerParams(temperature=0)
    new = request_ids if new is None else new
    new = [sampler_pb2.NewRequest(request_id=r, params=params, prompt_token_ids=prompt) for r in new]
    logits = tensor_to_proto(torch.arange(8, dtype=torch.float32).repeat(len(request_ids), 1))
    return sampler_pb2.SampleStep(
        step_id=step_id,
        new_requests=new,
        finished_request_ids=finished,
        request_ids=request_ids,
        num_new_tokens=[len(new_tokens)] * len(request_ids),
        new_token_ids=list(new_tokens) * len(request_ids),
        logits=logits,
    )


def refused_once_free(call) -> grpc.RpcError:
    """refused(call), retried while the sampler's one stream is still taken: a stream's end reaches the server a
    moment after its client is done with it."""
    deadline = time.monotonic() + 10
    while True:
        error = refused(call)
        if "--max-streams" not in error.details() or time.monotonic() > deadline:
            return error
        time.sleep(0.05)


class HeldStream:
    """A Sample stream that stays open until released."""

    def __init__(self, stub, first: sampler_pb2.SampleStep):
        self.release = threading.Event()

        def messages():
            yield first
            self.release.wait()

        self.replies = stub.Sample(messages(), timeout=60)
        self.first = next(self.replies)

    def close(self):
        self.release.set()
        self.replies.cancel()


def test_sampler_streams_and_their_state_are_bounded(sampler):
    with mesh_channel(sampler.address) as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        held = HeldStream(stub, step(1, ["a", "b"]))  # its two requests: the most one stream keeps
        try:
            assert list(held.first.sampled_token_ids) == [7, 7]
            error = refused(lambda: list(stub.Sample(iter([step(1, ["c"])]), timeout=30)))
            assert "--max-streams" in error.details()
        finally:
            held.close()
        # A step that would keep a third request's state ends its stream.
        error = refused_once_free(lambda: list(stub.Sample(iter([step(1, ["a", "b"]), step(2, ["c"])]), timeout=30)))
        assert "new_requests" in error.details() and "--max-requests-per-stream (2)" in error.details()


def test_sampler_bounds_the_tokens_a_stream_keeps(sampler):
    """--max-tokens-per-stream 12: prompts and outputs kept for penalties count, a finished request's are let go,
    and a step that would keep a thirteenth token ends its stream."""
    steps = [
        step(1, ["a"], prompt=[1] * 8),  # 8 kept
        step(2, ["a"], new=[], new_tokens=[7] * 4),  # 12: at the bound
        step(3, ["b"], prompt=[2] * 11, finished=["a"]),  # a's 12 let go: 11
        step(4, ["b"], new=[], new_tokens=[7]),  # 12
        step(5, ["b"], new=[], new_tokens=[7]),  # 13: refused
    ]
    answered = []
    with mesh_channel(sampler.address) as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        error = refused_once_free(lambda: answered.extend(stub.Sample(iter(steps), timeout=30)))
    assert [r.step_id for r in answered] == [1, 2, 3, 4]
    assert "--max-tokens-per-stream (12)" in error.details() and "13 prompt and output tokens" in error.details()


def test_every_server_bounds_its_concurrent_calls(sampler):
    """--max-concurrent-rpcs 2: two open Watch streams, and a third call of any kind is refused by gRPC itself."""
    with mesh_channel(sampler.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(2)]
        try:
            for watch in watches:
                next(watch)
            refused(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10))
        finally:
            for watch in watches:
                watch.cancel()
        deadline = time.monotonic() + 10
        while True:  # the watches' ends reach the server a moment after the cancel
            try:
                health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
