"""A drain that loses nothing: SIGTERM to one engine of `llmmesh serve --engines 2` with eight streams in flight.
The engine turns NOT_SERVING and gives them --shutdown-timeout; those that finish in time finish on it, and those
still running end UNAVAILABLE ("the engine is stopping"), which the gateway answers by moving them to the other
engine. No client sees an error, every output is the undisturbed one, and serve starts the engine again."""

import os
import signal

import grpc
import pytest
from test_migration import migrations, serving_two_engines, wait_restarted
from test_watchdog import WAIT_S, run_all, tiny_model  # noqa: F401 (tiny_model: a fixture)

from conftest import mesh_channel
from llmmesh.v1 import engine_pb2, engine_pb2_grpc
from services.client import sampling_params

SHUTDOWN_TIMEOUT = 3
# Half end within the drain, half run far longer; greedy and seeded, one of n=2.
REQUESTS = {
    f"{kind}/{i}": ([5 + i, 6 + i, 7 + i], dict(params, max_tokens=8 if i % 2 else 2000, ignore_eos=True))
    for i, (kind, params) in enumerate(
        [
            ("greedy", dict(temperature=0.0)),
            ("greedy", dict(temperature=0.0)),
            ("seeded", dict(temperature=1.0, seed=3)),
            ("seeded", dict(temperature=0.8, seed=4, frequency_penalty=0.5)),
            ("n2", dict(temperature=0.9, seed=5, n=2)),
            ("n2", dict(temperature=0.9, seed=6, n=2)),
            ("greedy", dict(temperature=0.0, logprobs=2)),
            ("seeded", dict(temperature=1.0, seed=7, min_tokens=4)),
        ]
    )
}


@pytest.fixture(scope="module")
def mesh(tiny_model):
    flags = ("--model", str(tiny_model), "--kv-cache-memory", "32MiB", "--no-kv-store", "--no-sampler-service")
    with serving_two_engines(*flags, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)) as process:
        yield process


def test_sigterm_to_an_engine_loses_no_stream(mesh):
    undisturbed = run_all(mesh, requests=REQUESTS)
    assert migrations(mesh) == 0
    address, pid, _ = mesh.services["engine"]
    with mesh_channel(address) as channel:
        # A client of the engine itself, its request far longer than the drain: at its end, UNAVAILABLE saying
        # why, never CANCELLED.
        direct = engine_pb2_grpc.EngineStub(channel).Generate(
            engine_pb2.EngineGenerateRequest(
                prompt_token_ids=[1, 2, 3], sampling_params=sampling_params(max_tokens=8000, ignore_eos=True)
            ),
            timeout=WAIT_S,
        )
        next(direct)
        assert run_all(mesh, lambda: os.kill(pid, signal.SIGTERM), REQUESTS) == undisturbed
        with pytest.raises(grpc.RpcError) as stopped:
            for _ in direct:
                pass
    assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"the engine is stopping: its --shutdown-timeout ({SHUTDOWN_TIMEOUT} s) is over" in stopped.value.details()
    assert migrations(mesh) >= 1
    mesh.expect(r"requests still running at the end of the drain end UNAVAILABLE")
    wait_restarted(mesh, "engine", "exit code 0")
