"""What every service gets from the one server helper (services/server.py), on the real services in-process:
a keepalive policy both ends of a link agree on, an engine whose thread dies that ends (and a gateway that stops
routing to that engine), and requests that do not decode refused with INVALID_ARGUMENT."""

import asyncio

import grpc
import pytest

import services.server
from conftest import (
    NOT_SERVING,
    SERVING,
    InProcessService,
    aio_mesh_channel,
    mesh_channel,
    undecodable,
    wait_for_health,
)
from engine.core import EngineCore
from llmmesh.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.client import collect, generate


@pytest.fixture(scope="module")
def text_services():
    services = {}
    try:
        for name in ("tokenizer", "detokenizer"):
            services[name] = InProcessService(name)
        yield services
    finally:
        for s in services.values():
            s.stop()


# ---- keepalive -----------------------------------------------------------------------------------

# The policy's pings every second instead of every 10 (gRPC clients send keepalive pings at most once a
# second), so idling through several intervals takes seconds. Only the intervals change: what the server
# accepts relative to what the client sends stays the policy's.
KEEPALIVE_MS = 1000
IDLE_INTERVALS = 6  # a server with gRPC's default ping policy answers GOAWAY at about the 4th ping
BREAK_WITHIN_S = 60  # how long the stream to such a server may take to break (it ends the wait when it does)


def faster(options: list[tuple[str, int]]) -> list[tuple[str, int]]:
    scale = services.server.KEEPALIVE_TIME_MS / KEEPALIVE_MS
    timings = ("grpc.keepalive_time_ms", "grpc.http2.min_ping_interval_without_data_ms")
    return [(k, int(v / scale) if k in timings else v) for k, v in options]


def grpc_default_ping_policy(options: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """A server that accepts gRPC's defaults: one ping in 5 minutes without data, GOAWAY after 2 strikes."""
    policy = ("grpc.http2.min_ping_interval_without_data_ms", "grpc.http2.max_ping_strikes")
    return [(k, v) for k, v in options if k not in policy]


def test_the_policy_accepts_what_the_clients_send():
    server, client = dict(services.server.SERVER_OPTIONS), dict(services.server.CHANNEL_OPTIONS)
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert client["grpc.keepalive_permit_without_calls"] == server["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.http2.max_pings_without_data"] == 0  # a long idle stream keeps pinging


async def idle_detokenize_stream(address: str, idle_s: float):
    """Open a Detokenize stream with one request, let it idle for idle_s (the client pings all along), then finish the
    request on the same stream. Returns its last result, or the error that broke the stream while it idled."""
    async with aio_mesh_channel(address, server="detokenizer", options=services.server.CHANNEL_OPTIONS) as channel:
        call = detokenizer_pb2_grpc.DetokenizerStub(channel).Detokenize()
        start = detokenizer_pb2.DetokenizeItem(request_id="idle", start=detokenizer_pb2.DetokenizeStart())
        await call.write(detokenizer_pb2.DetokenizeBatch(items=[start]))
        assert (await call.read()).results[0].request_id == "idle"
        reply = asyncio.ensure_future(call.read())
        # Idling is what is tested here, so this waits the whole window unless the stream breaks first.
        await asyncio.wait([reply], timeout=idle_s)
        if reply.done():
            try:
                return reply.result()
            except grpc.aio.AioRpcError as e:
                return e
        step = detokenizer_pb2.DetokenizeStep(token_ids=[6004], finished=True)  # "hi"
        await call.write(
            detokenizer_pb2.DetokenizeBatch(items=[detokenizer_pb2.DetokenizeItem(request_id="idle", step=step)])
        )
        return (await reply).results[0]


@pytest.mark.parametrize("server_policy", ["ours", "grpc-default"])
def test_an_idle_stream_survives_keepalive(monkeypatch, server_policy):
    """A client with CHANNEL_OPTIONS on a Detokenize stream that idles for several ping intervals: our servers
    (SERVER_OPTIONS) let it live; a server with gRPC's default ping policy breaks it (GOAWAY too_many_pings), which
    is what the policy is there to prevent."""
    monkeypatch.setattr(services.server, "CHANNEL_OPTIONS", faster(services.server.CHANNEL_OPTIONS))
    server_options = faster(services.server.SERVER_OPTIONS)
    if server_policy == "grpc-default":
        server_options = grpc_default_ping_policy(server_options)
    monkeypatch.setattr(services.server, "SERVER_OPTIONS", server_options)
    idle_s = IDLE_INTERVALS * KEEPALIVE_MS / 1000 if server_policy == "ours" else BREAK_WITHIN_S
    with InProcessService("detokenizer") as detokenizer:
        result = asyncio.run(idle_detokenize_stream(detokenizer.address, idle_s))
    if server_policy == "ours":
        assert not isinstance(result, Exception), result
        assert (result.text, result.finished) == ("hi", True)
    else:
        assert isinstance(result, grpc.aio.AioRpcError), (
            f"the stream outlived a server that refuses the pings: {result}"
        )
        assert result.code() == grpc.StatusCode.UNAVAILABLE and "too many pings" in result.details().lower()


# ---- health tells the truth -------------------------------------------------------------------------


class EngineThreadKilled(BaseException):
    """Not an Exception: no request's error handling catches it, so it ends the engine thread."""


def test_health_follows_the_engine_thread_and_the_gateway_routes_around_it(monkeypatch, text_services):
    real_step = EngineCore.step

    def step(self):
        if "fatal" in self.scheduler.requests:
            raise EngineThreadKilled("the engine thread is killed by the test")
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", step)
    engine = InProcessService("engine", ["--kv-cache-memory", "64MiB", "--shutdown-timeout", "5"])
    gateway = None
    try:
        gateway = InProcessService(
            "gateway",
            [
                "--engine",
                engine.address,
                "--tokenizer",
                text_services["tokenizer"].address,
                "--detokenizer",
                text_services["detokenizer"].address,
                "--shutdown-timeout",
                "5",
            ],
        )
        greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
        assert collect(generate(gateway.address, "Hello", **greedy)).choice().finish_reason == "length"

        with mesh_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            params = common_pb2.SamplingParams(**greedy)
            with pytest.raises(grpc.RpcError) as err:  # the request running when the thread dies
                list(
                    stub.Generate(
                        engine_pb2.EngineGenerateRequest(
                            request_id="fatal", prompt_token_ids=[1, 2, 3], sampling_params=params
                        )
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "EngineThreadKilled" in err.value.details()
        # A dead engine serves nothing again: its process ends with code 1, to be restarted.
        assert engine.wait_exit() == 1

        # The gateway's health follows its only engine's, and it sends nothing to an engine that is not healthy.
        wait_for_health(gateway.address, NOT_SERVING)
        with pytest.raises(grpc.RpcError) as err:
            collect(generate(gateway.address, "Hello", **greedy))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details().startswith("no engine is healthy")
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


# ---- requests that do not decode ----------------------------------------------------------------


def test_undecodable_requests_are_invalid_argument_and_the_services_go_on(text_services):
    tokenizer, detokenizer = text_services["tokenizer"].address, text_services["detokenizer"].address
    with mesh_channel(tokenizer) as channel:
        tokenize = channel.unary_unary(
            "/llmmesh.v1.Tokenizer/Tokenize", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as err:
            tokenize(undecodable(tokenizer_pb2.TokenizeRequest))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not decode" in err.value.details()
        reply = tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"))
        assert list(reply.token_ids) == [6004]
    with mesh_channel(detokenizer) as channel:
        stream = channel.stream_stream(
            "/llmmesh.v1.Detokenizer/Detokenize", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stream(iter([undecodable(detokenizer_pb2.DetokenizeBatch)])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not decode" in err.value.details()
        good = detokenizer_pb2.DetokenizeBatch(
            items=[
                detokenizer_pb2.DetokenizeItem(request_id="r", start=detokenizer_pb2.DetokenizeStart()),
                detokenizer_pb2.DetokenizeItem(
                    request_id="r", step=detokenizer_pb2.DetokenizeStep(token_ids=[6004], finished=True)
                ),
            ]
        )
        [reply] = detokenizer_pb2_grpc.DetokenizerStub(channel).Detokenize(iter([good]))
        assert reply.results[1].text == "hi"
    for address in (tokenizer, detokenizer):
        wait_for_health(address, SERVING, timeout=5)
