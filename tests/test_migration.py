"""Requests that survive their engine: under `llmmesh serve --engines 2`, an engine killed with streams in flight
loses none of them. Each stream's unfinished completions resume on the other engine with the tokens already sent
(the KV store holds their blocks, or, with the store stopped, they are recomputed), and every client sees the
output an undisturbed run gives: greedy, seeded, n=2, a stop string, logprobs and a JSON schema alike."""

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import urllib.request

import pytest
from test_serve import SERVING_LINE, WAIT_S, Serve

from conftest import SERVING, wait_for_health
from llmmesh.v1 import common_pb2
from services.client import collect, generate

PROMPTS = ["The capital of France is", "def quicksort(items):", "Three facts about the Moon:"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
# Long enough to be running when the engine is killed, short enough for a loaded 2-core machine.
KINDS = {
    "greedy": dict(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, frequency_penalty=0.5),
    "n2": dict(temperature=0.9, seed=5, n=2, max_tokens=24, ignore_eos=True),
    "stop": dict(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["answer"], min_tokens=2),
    "logprobs": dict(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    "json": dict(
        temperature=0.8,
        seed=3,
        max_tokens=24,
        structured_outputs=common_pb2.StructuredOutputsParams(json=json.dumps(SCHEMA)),
    ),
}


@contextlib.contextmanager
def serving_two_engines(*flags: str):
    """`llmmesh serve --engines 2` with FLAGS, once every service is serving: the streams alternate between the
    engines (round-robin), so both hold some when one goes away, and a prefix recomputed in float32 gives the same
    logits, so the continuations are exact."""
    process = Serve(
        [
            *("--port", "0", "--engines", "2", "--routing", "round-robin", "--dtype", "float32"),
            *("--log-level", "WARNING", "--metrics-port", "0", *flags),
        ]
    )
    try:
        while "gateway" not in process.services:  # the gateway starts last
            name, address, pid, metrics = process.expect(SERVING_LINE).groups()
            process.services[name] = (address, int(pid), metrics)
        process.address = process.expect(r"llmmesh gateway listening on (\S+)").group(1)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def mesh():
    with serving_two_engines("--kv-cache-memory", "64MiB") as process:
        yield process


def requests():
    return [(f"{kind}/{i}", PROMPTS[i % len(PROMPTS)], params) for i, (kind, params) in enumerate(KINDS.items())]


def outcome(result) -> dict:
    """What a client sees of one request: per choice its text, tokens, finish and logprobs."""
    choices = {}
    for c in result.complete.choices:
        choices[c.index] = (result.text(c.index), result.token_ids[c.index], c.finish_reason, c.stop_str)
    return choices


def logprobs(stream_responses) -> list[tuple[int, float]]:
    """Token and logprob entries; a recomputed prefix moves a logprob in its last digits."""
    return [
        (e.token_id, e.logprob)
        for r in stream_responses
        if r.HasField("chunk")
        for d in r.chunk.choices
        for p in d.logprobs
        for e in p.entries
    ]


def assert_same(got: dict, want: dict) -> None:
    """Each request's outputs as undisturbed, its logprobs within the last digits."""
    assert got.keys() == want.keys()
    for name in want:
        (choices, entries), (want_choices, want_entries) = got[name], want[name]
        assert choices == want_choices, name
        assert [t for t, _ in entries] == [t for t, _ in want_entries], name
        assert [lp for _, lp in entries] == pytest.approx([lp for _, lp in want_entries], abs=1e-3), name


def migrations(mesh) -> float:
    with urllib.request.urlopen(f"http://{mesh.services['gateway'][2]}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(r"^llmmesh:request_migrations_total (\S+)$", text, re.M)
    assert match, text[-2000:]
    return float(match.group(1))


def run_all(mesh, during=None) -> dict:
    """Every request at once; during(): called once each has streamed a few tokens."""
    started = concurrent.futures.ThreadPoolExecutor(len(KINDS))
    streams = {name: generate(mesh.address, prompt, timeout=WAIT_S, **params) for name, prompt, params in requests()}
    firsts = {name: [next(s), next(s)] for name, s in streams.items()}  # every one is running in an engine
    if during is not None:
        during()
    futures = {name: started.submit(lambda s=s: list(s)) for name, s in streams.items()}
    results = {}
    for name, future in futures.items():
        responses = firsts[name] + future.result()
        results[name] = (outcome(collect(responses)), logprobs(responses))
    started.shutdown()
    return results


def wait_restarted(mesh, name: str, status: str = "killed by SIGKILL") -> None:
    """serve started the engine that exited (its exit status) again, and it serves."""
    mesh.expect(rf"the {name} exited \({status}\)")
    while True:
        started, address, pid, metrics = mesh.expect(SERVING_LINE).groups()
        if started == name:
            break
    mesh.services[name] = (address, int(pid), metrics)
    wait_for_health(address, SERVING)


@pytest.fixture(scope="module")
def undisturbed(mesh):
    outputs = run_all(mesh)
    assert migrations(mesh) == 0
    return outputs


def test_streams_survive_an_engine_killed_mid_stream(mesh, undisturbed):
    assert_same(run_all(mesh, lambda: os.kill(mesh.services["engine"][1], signal.SIGKILL)), undisturbed)
    assert migrations(mesh) >= 1
    wait_restarted(mesh, "engine")


def test_streams_survive_with_the_kv_store_stopped(mesh, undisturbed):
    """What the store would have given is recomputed, to the same outputs."""
    before = migrations(mesh)
    store_pid = mesh.services["kvstore"][1]

    def stop_store_and_kill():
        os.kill(store_pid, signal.SIGSTOP)
        os.kill(mesh.services["engine-2"][1], signal.SIGKILL)

    try:
        assert_same(run_all(mesh, stop_store_and_kill), undisturbed)
    finally:
        os.kill(store_pid, signal.SIGCONT)
    assert migrations(mesh) > before
    wait_restarted(mesh, "engine-2")
