"""The added latency of a migration: the gap in a client's stream when its engine is killed mid-decode, with the KV
store (the new engine loads the request's blocks) and without it (it recomputes them).

    .venv/bin/python benchmarks/migration.py [--contexts 256 2048] [--rounds 3] [--before-kill 32]
        [--after-kill 32] [--model smollm2-135m-instruct] [--dtype float32] [--output-json PATH]

Two meshes (services.local_mesh.Mesh, `llmmesh serve`'s processes with two engines), one at a time: one with the KV
store, whose engines store their generated tokens' full blocks too (store_decode_blocks, as `llmmesh serve` turns
it on), and one without. Each round, for each context length C: a seeded random prompt of C - --before-kill token
ids streams greedily through the gateway; once --before-kill tokens have come (C tokens of context), the engine
running it is killed with SIGKILL and the gateway moves the request to the other engine, which streams
--after-kill more. Then the killed engine is started again, and the same prompt runs undisturbed. Reported per
round and as medians: the gap in the stream at the kill (the longest between two tokens from the last one before
the kill on), the longest gap between tokens before the kill (the decode's own; the first token's wait aside),
and whether the output equals the undisturbed run's.
"""

import argparse
import json
import os
import platform
import random
import signal
import statistics
import time
from pathlib import Path

from engine.config import EngineArgs
from llmmesh.v1 import engine_pb2, engine_pb2_grpc
from mesh import tls
from services import client
from services.dependencies import HEALTH_INTERVAL
from services.local_mesh import Mesh

FIRST_REGULAR_ID = 17  # SmolLM2's special tokens are ids 0..16


def stream_times(address: str, prompt: list[int], max_tokens: int, on_token=None) -> tuple[list[int], list[float]]:
    """A greedy stream's tokens and when each came; on_token(count) after each chunk that carried tokens."""
    tokens, times = [], []
    params = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for response in client.generate(address, prompt, timeout=600, **params):
        if response.HasField("chunk"):
            new = [t for d in response.chunk.choices for t in d.token_ids]
            if new:
                tokens += new
                times += [time.perf_counter()] * len(new)
                if on_token is not None:
                    on_token(len(tokens))
    return tokens, times


def running_engine(mesh: Mesh, tries: int = 50) -> str:
    """The engine with a request running (its load is read after each step, so ask again a few times)."""
    for _ in range(tries):
        for name in mesh.engine_names:
            credentials = tls.MeshCredentials(mesh.tls_dir, "gateway")  # the engine's caller
            with tls.channel(mesh.services[name].address, "engine", credentials) as ch:
                if engine_pb2_grpc.EngineStub(ch).GetLoad(engine_pb2.GetLoadRequest(), timeout=10).num_running:
                    return name
        time.sleep(0.02)
    raise RuntimeError("no engine runs the request")


def one_kill(mesh: Mesh, prompt: list[int], args) -> dict:
    """The stream's tokens, and its gaps: the longest from the last token before the kill on (the migration's),
    and the longest before it (the decode's own)."""
    killed = {}

    def on_token(count: int) -> None:
        if not killed:  # found at the first token, so that nothing but the kill happens at the kill
            killed["name"] = running_engine(mesh)
        elif count >= args.before_kill and "at" not in killed:
            mesh.services[killed["name"]].popen.send_signal(signal.SIGKILL)
            killed["at"] = time.perf_counter()

    tokens, times = stream_times(mesh.address, prompt, args.before_kill + args.after_kill, on_token)
    mesh.restart(killed["name"])
    time.sleep(4 * HEALTH_INTERVAL)  # the gateway sees it healthy again: the next kill has somewhere to go
    last = sum(t <= killed["at"] for t in times) - 1

    def longest_gap(ts: list[float]) -> float:
        return 1000 * max((b - a for a, b in zip(ts, ts[1:])), default=0.0)

    return {
        "killed": killed["name"],
        "tokens": tokens,
        "gap_at_kill_ms": longest_gap(times[last:]),
        "longest_gap_before_ms": longest_gap(times[1 : last + 1]),
    }


def run(store: bool, args) -> dict:
    engine_args = EngineArgs(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    options = {"store_decode_blocks": True} if store else {}
    results = {c: [] for c in args.contexts}
    mesh = Mesh(engine_args, ["--migration-limit", "3"], num_engines=2, kv_store=store, kv_connector_options=options)
    with mesh:
        for r in range(args.rounds):
            for context in args.contexts:
                rng = random.Random(f"{r}/{context}")  # fresh in each mesh, so nothing of it is cached
                prompt = rng.choices(range(FIRST_REGULAR_ID, args.vocab), k=context - args.before_kill)
                result = one_kill(mesh, prompt, args)
                reference, _ = stream_times(mesh.address, prompt, len(result["tokens"]))
                result["same_output"] = result.pop("tokens") == reference
                print(f"{'store' if store else 'no store'} round {r} context {context}: {result}", flush=True)
                results[context].append(result)
    return results


def summary(results: list[dict]) -> dict:
    """The medians over rounds of one context length, and whether every round's output was the undisturbed one."""
    medians = {m: statistics.median(x[m] for x in results) for m in ("gap_at_kill_ms", "longest_gap_before_ms")}
    return {**medians, "same_output": all(x["same_output"] for x in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-kill", type=int, default=32, help="tokens streamed before the kill")
    ap.add_argument("--after-kill", type=int, default=32, help="tokens streamed after it")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}", flush=True)
    runs = {"with the KV store": run(True, args), "without it": run(False, args)}
    medians = {name: {c: summary(results) for c, results in by_context.items()} for name, by_context in runs.items()}
    print(json.dumps(medians, indent=2))
    if args.output_json:
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        report = dict(machine=machine, date=date, args=vars(args), runs=runs, median=medians)
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
