"""The step watchdog: health tells whether an engine steps, not only whether its server answers. A step stuck in a
kernel (an injected sleep) or in a collective with a stopped tensor-parallel rank turns the engine NOT_SERVING and
ends its requests UNAVAILABLE after --step-timeout, and ends the process with code 1 after --step-timeout-exit. A
whole engine stopped with SIGSTOP, whose watchdog is stopped with it, is seen from outside: under `llmmesh serve
--engines 2` the gateway moves its streams to the other engine once it has failed its health checks for
--step-timeout, long before serve kills it (--step-timeout-exit) and starts it again, with no client error."""

import os
import signal
import subprocess

import grpc
import pytest
from test_migration import migrations, serving_two_engines, wait_restarted

from conftest import NOT_SERVING, SERVING, mesh_channel, wait_for_health
from llmmesh.v1 import engine_pb2, engine_pb2_grpc
from random_model import save_random_smollm2_shaped
from services.client import collect, generate, sampling_params
from services.service_process import ServiceProcess
from services.supervisor import answers_health
from test_models import COMMON

STEP_TIMEOUT, STEP_TIMEOUT_EXIT = 2, 8  # one engine on its own: short, its steps take milliseconds
WAIT_S = 120.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-watchdog")
    save_random_smollm2_shaped(path, **{**COMMON, "max_position_embeddings": 8192})
    return path


def start_engine(model, *flags, env=None) -> ServiceProcess:
    limits = ["--step-timeout", str(STEP_TIMEOUT), "--step-timeout-exit", str(STEP_TIMEOUT_EXIT)]
    args = ["--port", "0", "--model", str(model), "--dtype", "float32", "--kv-cache-memory", "16MiB", *limits]
    process = ServiceProcess("engine", [*args, "--log-level", "WARNING", *flags], env=env)
    process.wait_listening(WAIT_S)
    return process


def open_stream(channel, max_tokens: int):
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = engine_pb2.EngineGenerateRequest(prompt_token_ids=[5, 6, 7], sampling_params=params)
    return engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=WAIT_S)


def assert_ends_stuck(stream) -> None:
    """The stream ends UNAVAILABLE, saying the step ran past --step-timeout."""
    with pytest.raises(grpc.RpcError) as failure:
        for _ in stream:
            pass
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value
    assert f"past --step-timeout ({STEP_TIMEOUT} s)" in failure.value.details()


def test_a_stuck_step_makes_the_engine_not_serving_then_exit(tiny_model):
    """Step 3 sleeps past --step-timeout but ends before the exit limit: the engine serves again. Step 10 never ends
    in time: the engine exits with code 1."""
    engine = start_engine(tiny_model, env={"LLMMESH_STUCK_STEP": f"3:{STEP_TIMEOUT + 3},10:600"})
    try:
        with mesh_channel(engine.address) as channel:
            stream = open_stream(channel, max_tokens=10)
            next(stream)  # step 1, its prefill
            assert_ends_stuck(stream)
            wait_for_health(engine.address, NOT_SERVING)
            with pytest.raises(grpc.RpcError) as refused:  # no new request while the step is stuck
                list(open_stream(channel, max_tokens=2))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "past --step-timeout" in refused.value.details()

            wait_for_health(engine.address, SERVING)  # step 3 ended
            done = list(open_stream(channel, max_tokens=5))  # steps 5 to 9 (4 frees the first one's blocks)
            assert sum(len(d.token_ids) for msg in done for d in msg.outputs) == 5

            assert_ends_stuck(open_stream(channel, max_tokens=10))
            assert engine.alive()  # NOT_SERVING first, the exit only past the second limit
        assert engine.popen.wait(timeout=WAIT_S) == 1
    finally:
        if engine.alive():
            engine.kill()


def rank_processes(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid), "-f", "engine.executor.multiproc"], capture_output=True)
    return [int(p) for p in found.stdout.split()]


def test_a_stopped_tensor_parallel_rank_is_seen_from_inside(tiny_model):
    """A rank stopped with SIGSTOP leaves rank 0 in a collective that never completes: the watchdog sees the step."""
    engine = start_engine(tiny_model, "--tensor-parallel-size", "2")
    (rank1,) = rank_processes(engine.popen.pid)
    try:
        with mesh_channel(engine.address) as channel:
            stream = open_stream(channel, max_tokens=500)
            next(stream)
            os.kill(rank1, signal.SIGSTOP)
            assert_ends_stuck(stream)
            wait_for_health(engine.address, NOT_SERVING)
        assert engine.popen.wait(timeout=WAIT_S) == 1
    finally:
        os.kill(rank1, signal.SIGKILL)
        if engine.alive():
            engine.kill()


# ---- a whole engine stopped, under llmmesh serve ------------------------------------------------------------

# Every service of a loaded machine answers well within these; the streams move after the first, serve kills the
# stopped engine after the second.
SERVE_STEP_TIMEOUT, SERVE_STEP_TIMEOUT_EXIT = 3, 30
# Tokens: every stream still runs when the engine stops, even where one stream's first token comes late (400 can run
# out in under a second on an idle machine, before the last first token arrives).
LONG = 3000
REQUESTS = {
    "greedy/0": ([5, 6, 7], dict(temperature=0.0, max_tokens=LONG, ignore_eos=True)),
    "greedy/1": ([8, 9, 10, 11], dict(temperature=0.0, max_tokens=LONG, ignore_eos=True)),
    "seeded/2": ([12, 13], dict(temperature=1.0, seed=7, max_tokens=LONG, ignore_eos=True)),
    "n2/3": ([14, 15, 16], dict(temperature=0.9, seed=5, n=2, max_tokens=LONG, ignore_eos=True)),
}


@pytest.fixture(scope="module")
def mesh(tiny_model):
    limits = ("--step-timeout", str(SERVE_STEP_TIMEOUT), "--step-timeout-exit", str(SERVE_STEP_TIMEOUT_EXIT))
    flags = ("--model", str(tiny_model), "--kv-cache-memory", "16MiB", "--no-kv-store", "--no-sampler-service")
    with serving_two_engines(*flags, *limits) as process:
        yield process


def run_all(mesh, during=None, requests: dict = REQUESTS) -> dict:
    """Every request at once (name -> prompt, sampling), each choice's tokens and finish; during(): called once each
    has streamed tokens."""
    streams = {name: generate(mesh.address, prompt, timeout=WAIT_S, **p) for name, (prompt, p) in requests.items()}
    firsts = {name: next(stream) for name, stream in streams.items()}
    if during is not None:
        during()
    results = {}
    for name, stream in streams.items():
        result = collect([firsts[name], *stream])
        results[name] = {c.index: (result.token_ids[c.index], c.finish_reason) for c in result.complete.choices}
    return results


def process_state(pid: int) -> str:
    """Its state letter (T: stopped); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def test_a_stopped_engine_loses_no_stream_and_serve_restarts_it(mesh):
    undisturbed = run_all(mesh)
    assert migrations(mesh) == 0
    address, pid, _ = mesh.services["engine"]

    def stop_engine():
        with mesh_channel(address, "engine") as channel:
            assert answers_health(channel, 5.0)  # as serve checks it
        os.kill(pid, signal.SIGSTOP)

    try:
        # The streams end on the other engine while this one is still stopped: the gateway moved them, not serve's
        # kill. No client error, no token lost or repeated.
        assert run_all(mesh, stop_engine) == undisturbed
        assert process_state(pid) == "T", "the streams waited for serve to kill the engine"
        assert migrations(mesh) >= 1
        # New requests go to the other engine alone (round-robin would send every other one here).
        for _ in range(2):
            again = collect(generate(mesh.address, [5, 6, 7], temperature=0.0, max_tokens=8, ignore_eos=True))
            assert again.token_ids[0] == undisturbed["greedy/0"][0][0][:8]
        assert process_state(pid) == "T"
        mesh.expect(rf"the engine \(pid {pid}\) has answered no health check for \d+ s, past --step-timeout-exit")
    except BaseException:
        # A failure above: it must not stay stopped. Not otherwise: serve is killing it, and a stopped engine
        # resumed first would see its step past --step-timeout-exit and exit on its own before the kill lands.
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)
        raise
    wait_restarted(mesh, "engine")
    again = collect(generate(mesh.address, REQUESTS["greedy/0"][0], temperature=0.0, max_tokens=8, ignore_eos=True))
    assert again.token_ids[0] == undisturbed["greedy/0"][0][0][:8]
