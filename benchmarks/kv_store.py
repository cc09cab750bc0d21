"""KV store benchmark: time to first token when a prompt's prefix is recomputed, hit in the local prefix cache,
or loaded from the kvstore (after the local cache is reset, and on a second engine), and the store's throughput;
then a multi-turn workload through the mesh with a KV pool far smaller than the working set, with and without
the store.

    .venv/bin/python benchmarks/kv_store.py [--lengths 512 2048 8192] [--dtypes float32 bfloat16 float32:fp8] [--rounds 3]
        [--skip-ttft] [--skip-mesh] [--skip-reload] [--conversations 6] [--turns 4] [--pool-blocks 96]

TTFT part: a real redis-server and a real `llmmesh kvstore` process; two EngineCores in this process (A and B)
with the KV connector (load_policy auto: the engine's own load-or-recompute choice). Each round draws a fresh
random prefix per length (so nothing is cached anywhere) and runs, in turn: cold on A (recompute; its blocks
go to the store), local hit on A, reload on A after reset_prefix_cache, second engine B. Each request is the
prefix plus its own 16-token suffix and asks for one token. Reported: per-round times and the median over
rounds of each variant and of cold/variant. A --dtypes entry is the model's dtype, or DTYPE:KV_CACHE_DTYPE for
another KV cache dtype (float32:fp8: float32 compute, fp8 blocks in the cache and the store); the same prefixes
for every entry of one model dtype.

Reload part: the same reload through `llmmesh serve`'s processes (services.local_mesh.Mesh with the KV store), one
mesh per --dtypes entry, its engine's pool just large enough for one prompt. Each round, through the gateway and
with token ids: cold (prefix + suffix: recompute; its blocks go to the store); another prompt of the same length,
which evicts the prefix from the pool; reload while storing (the prefix + another suffix, loaded from the store
while the other prompt's blocks are still being stored); a third prompt, which evicts it again; a wait until the
kvstore has stored them all; reload (the prefix + a third suffix, the store otherwise idle); local hit. Then, in
the same round, the prefix's blocks read straight from Redis with one synchronous MGET of redis-py (the bytes
alone), the same MGET received in place as the kvstore receives it (services/block_reader.py), and through the
kvstore's Get, carried as bytes and through shared memory as the engine's loads are; then the engine's own work on
those bytes, timed apart: their tags verified under the mesh's block key, and the blocks copied into a KV cache of
the engine's shape. Reported: per-round times and medians, cold/reload, and reload over the bytes alone (and over
the read in place).

Mesh part: two copies of `llmmesh serve`'s processes (services.local_mesh.Mesh) up at once, one with the
store and one without. Conversations advance turn by turn in lockstep (turn 1 of every conversation, then
turn 2...), each turn the whole history plus a new user message, greedy, so the pool (--pool-blocks)
evicts a conversation's blocks before its next turn. Each turn goes to both meshes back to back, the order
alternating. Reported: TTFT per turn for each, the median per turn of the paired ratio, and whether
both produced the same text.
"""

import argparse
import json
import platform
import random
import statistics
import sys
import time

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams
from llmmesh.v1 import kvstore_pb2
from mesh import tls
from mesh.kvstore.block_tag import KEY_FILE, TAG_BYTES, BlockTagger
from mesh.kvstore.client import KVStoreClient, Staging
from services import client
from services.block_reader import BlockReader
from services.certs import make_credentials, redis_password
from services.kvstore_layout import DTYPES
from services.kvstore_service import redis_url_with_password
from services.local_mesh import Mesh, kv_transfer_config
from services.redis_server import RedisServer
from services.service_process import ServiceProcess

FIRST_REGULAR_ID = 17  # SmolLM2's special tokens are ids 0..16
SUFFIX = 16


def ttft(engine: EngineCore, prompt: list[int], request_id: str) -> float:
    started = time.perf_counter()
    engine.add_request(Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1)))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                seconds = time.perf_counter() - started
                while engine.has_unfinished_requests():  # the stores end before the next variant
                    engine.step()
                return seconds


def run_ttft(args) -> dict:
    results = {}
    with RedisServer(maxmemory="8gb") as redis:
        kvstore = ServiceProcess("kvstore", ["--port", "0", "--redis-url", redis.url])
        address = kvstore.wait_listening(120)
        try:
            for config in args.dtypes:
                dtype, _, kv_cache_dtype = config.partition(":")
                engine_args = dict(
                    dtype=dtype,
                    kv_cache_dtype=kv_cache_dtype or "auto",
                    kv_cache_memory="2GiB",
                    kv_transfer_config=kv_transfer_config(address),
                )
                a, b = EngineCore(EngineArgs(**engine_args)), EngineCore(EngineArgs(**engine_args))
                print(f"{config}: KV blocks of {a.worker.kv_layouts[0].block_bytes} bytes", flush=True)
                vocab = a.model_config.vocab_size
                for engine in (a, b):  # first-call costs out of the way
                    ttft(engine, [FIRST_REGULAR_ID] * 64, "warm-up")
                for length in args.lengths:
                    prefix_len = min(length, a.max_model_len - SUFFIX - 1)
                    rows = []
                    for r in range(args.rounds):
                        rng = random.Random(f"{dtype}-{length}-{r}")
                        prefix = [rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(prefix_len)]
                        suffixes = [[rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(SUFFIX)] for _ in range(4)]
                        a.reset_prefix_cache()
                        b.reset_prefix_cache()
                        before = dict(a.get_stats().kv_connector_stats)
                        row = {"cold": ttft(a, prefix + suffixes[0], f"cold-{length}-{r}"),
                               "local": ttft(a, prefix + suffixes[1], f"local-{length}-{r}")}  # fmt: skip
                        a.reset_prefix_cache()
                        row["reload"] = ttft(a, prefix + suffixes[2], f"reload-{length}-{r}")
                        row["second"] = ttft(b, prefix + suffixes[3], f"second-{length}-{r}")
                        after = a.get_stats().kv_connector_stats
                        row["reload_loaded_tokens"] = after["loaded_tokens"] - before["loaded_tokens"]
                        rows.append(row)
                        print(
                            f"{config} prefix {prefix_len}: round {r}: "
                            + ", ".join(
                                f"{k} {v:.3f} s" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                            ),
                            flush=True,
                        )
                    results[f"{config}/{prefix_len}"] = summarize(rows)
                for engine in (a, b):
                    engine.shutdown()
                del a, b
            results["store_throughput"] = store_throughput(address)
        finally:
            kvstore.stop()
    return results


def summarize(rows: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in rows) for k in ("cold", "local", "reload", "second")}
    ratios = {f"cold/{k}": statistics.median(r["cold"] / r[k] for r in rows) for k in ("local", "reload", "second")}
    return {"median_s": med, "median_ratio": ratios, "rounds": rows}


def store_throughput(address: str, num_blocks: int = 256) -> dict:
    """Put then Get of num_blocks SmolLM2 float32 blocks (random bytes) straight through the kvstore client."""
    import hashlib
    import os

    from mesh.kvstore.client import KVLayout, KVStoreClient

    layout = KVLayout("0" * 64, "float32", (30, 2, 3, 16, 64))
    blocks = [
        (hashlib.sha256(b"bench%d" % i).digest(), os.urandom(layout.block_bytes), bytes(32)) for i in range(num_blocks)
    ]
    store = KVStoreClient(address, [layout])
    megabytes = num_blocks * layout.block_bytes / 1e6
    started = time.perf_counter()
    store.put(layout, blocks, timeout=120)
    put_s = time.perf_counter() - started
    gets = []
    for _ in range(3):
        started = time.perf_counter()
        got = (
            sum(len(data) for data, _ in store.get(layout, [h for h, _, _ in blocks], timeout=120))
            // layout.block_bytes
        )
        gets.append(time.perf_counter() - started)
        assert got == num_blocks
    store.close()
    return {
        "megabytes": round(megabytes, 1),
        "put_MB_per_s": round(megabytes / put_s),
        "get_MB_per_s": round(megabytes / statistics.median(gets)),
    }


KV_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp8": "float8_e4m3fn"}


def first_token_s(address: str, prompt: list[int]) -> float:
    """Time to the first token of a one-token greedy generation through the gateway."""
    sent = time.perf_counter()
    for response in client.generate(address, prompt, max_tokens=1, temperature=0.0, ignore_eos=True):
        if response.HasField("chunk") and any(d.token_ids for d in response.chunk.choices):
            seconds = time.perf_counter() - sent
    return seconds


def wait_stored(kvstore, target: int, timeout: float = 120.0) -> None:
    """Until the kvstore has stored target blocks since it started (the engine's stores run after the answers)."""
    deadline = time.monotonic() + timeout
    while kvstore.Stats(kvstore_pb2.StatsRequest()).blocks_stored < target and time.monotonic() < deadline:
        time.sleep(0.05)


def engine_cache(layout, num_blocks: int):
    """A KVBlockIO over a KV cache of SmolLM2's shape with room for num_blocks + 2 blocks, as an engine's."""
    import torch

    from engine.kv.connector.block_io import KVBlockIO

    dtype = getattr(torch, layout.dtype)
    layers = [tuple(torch.zeros(3, num_blocks + 2, 16, 64, dtype=dtype) for _ in "kv") for _ in range(30)]
    return KVBlockIO(layers, layout)


def run_reload(args) -> dict:
    """Reload after eviction through the mesh, against recompute and the bytes alone (module docstring)."""
    import os

    import redis

    from engine.kv.layout import KVLayout
    from llmmesh.v1 import engine_pb2, engine_pb2_grpc, kvstore_pb2_grpc
    from services.routing import Router

    results = {}
    for config in args.dtypes:
        dtype, _, kv_cache_dtype = config.partition(":")
        cache_dtype = KV_DTYPE_NAMES[kv_cache_dtype or dtype]
        block_bytes = 30 * 2 * 3 * 16 * 64 * DTYPES[cache_dtype][1]  # SmolLM2's block
        for length in args.lengths:
            prompt_blocks = -(-(length + SUFFIX + 1) // 16)
            engine_args = EngineArgs(
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype or "auto",
                kv_cache_memory=str((prompt_blocks + 2) * block_bytes),  # one prompt: the next evicts it
            )
            with Mesh(engine_args, kv_store=True, redis_maxmemory="8gb") as mesh:
                as_gateway, as_engine = (tls.MeshCredentials(mesh.tls_dir, who) for who in ("gateway", "engine"))
                engine = engine_pb2_grpc.EngineStub(tls.channel(mesh.services["engine"].address, "engine", as_gateway))
                kvstore = kvstore_pb2_grpc.KVStoreStub(
                    tls.channel(mesh.services["kvstore"].address, "kvstore", as_engine)
                )
                router = Router(["engine"])
                router.set_model_info(engine.GetModelInfo(engine_pb2.GetModelInfoRequest()))
                vocab = 49152  # SmolLM2's
                redis_client = redis.Redis.from_url(mesh.redis.url, password=redis_password(mesh.tls_dir))
                redis_url = redis_url_with_password(mesh.redis.url, os.path.join(mesh.tls_dir, "redis.password"))
                first_token_s(mesh.address, [FIRST_REGULAR_ID] * 64)  # first-call costs out of the way
                rows, staging, into, cache = [], None, None, None
                with open(os.path.join(mesh.tls_dir, KEY_FILE)) as f:
                    tagger = BlockTagger(bytes.fromhex(f.read().strip()))  # the mesh's engine's
                for r in range(args.rounds):
                    rng = random.Random(f"reload-{config}-{length}-{r}")
                    prefix, *others = ([rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(length)] for _ in "abc")
                    suffixes = [[rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(SUFFIX)] for _ in range(5)]
                    stored = kvstore.Stats(kvstore_pb2.StatsRequest()).blocks_stored
                    row = {"cold": first_token_s(mesh.address, prefix + suffixes[0])}
                    row["evict"] = first_token_s(mesh.address, others[0] + suffixes[1])
                    row["reload_while_storing"] = first_token_s(mesh.address, prefix + suffixes[2])
                    first_token_s(mesh.address, others[1] + suffixes[1])
                    wait_stored(kvstore, stored + 3 * ((length + SUFFIX) // 16))
                    row["reload"] = first_token_s(mesh.address, prefix + suffixes[3])
                    row["local"] = first_token_s(mesh.address, prefix + suffixes[4])
                    hashes = router.block_hashes(prefix, None)
                    fingerprint = next(redis_client.scan_iter("kv:*", count=1000)).decode().split(":")[1]
                    keys = [f"kv:{fingerprint}:{h.hex()}" for h in hashes]
                    started = time.perf_counter()
                    values = redis_client.mget(keys)
                    row["redis_mget"] = time.perf_counter() - started
                    row["megabytes"] = round(sum(len(v) for v in values if v is not None) / 1e6, 1)
                    layout = KVLayout(fingerprint, cache_dtype, (30, 2, 3, 16, 64))
                    prefix_bytes = len(values[0]) - layout.block_bytes
                    if into is None:  # one buffer for the mesh, as the engine's segment is
                        into = memoryview(bytearray(len(keys) * layout.block_bytes))
                    started = time.perf_counter()
                    reader = BlockReader(redis_url, timeout=60)
                    reader.send(keys)
                    reader.read_values(len(keys))
                    for i in range(len(keys)):
                        block = into[i * layout.block_bytes : (i + 1) * layout.block_bytes]
                        assert reader.read_value(prefix_bytes, block, lambda prefix, data: True) == "ok"
                    reader.close()
                    row["redis_in_place"] = time.perf_counter() - started
                    store = KVStoreClient(mesh.services["kvstore"].address, [layout])
                    started = time.perf_counter()
                    got = sum(len(data) for data, _ in store.get(layout, hashes, timeout=60)) // layout.block_bytes
                    row["kvstore_get"] = time.perf_counter() - started
                    staging = staging or Staging(len(hashes), layout.block_bytes)  # one for the mesh, as an engine's
                    started = time.perf_counter()
                    tags = b"".join(t for _, t in store.get(layout, hashes, 60, staging=staging))
                    row["kvstore_get_shared"] = time.perf_counter() - started
                    assert got == len(hashes) and staging.taken and len(tags) == got * TAG_BYTES
                    store.close()
                    data = staging.view[: got * layout.block_bytes]
                    started = time.perf_counter()
                    verified = tagger.verified(fingerprint, hashes, data, tags, layout.block_bytes)
                    row["engine_verify"] = time.perf_counter() - started
                    assert verified == got, "the blocks' tags do not verify under the mesh's block key"
                    cache = cache or engine_cache(layout, got)
                    started = time.perf_counter()
                    cache.write(random.Random(r).sample(range(got + 2), got), data)
                    row["engine_copy"] = time.perf_counter() - started
                    rows.append(row)
                    print(
                        f"reload {config} {length}: round {r}: "
                        + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                        flush=True,
                    )
                staging.close()
            med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
            results[f"{config}/{length}"] = {
                "median": med,
                "median_cold_over_reload": statistics.median(row["cold"] / row["reload"] for row in rows),
                "median_reload_over_redis_mget": statistics.median(row["reload"] / row["redis_mget"] for row in rows),
                "median_reload_over_in_place": statistics.median(row["reload"] / row["redis_in_place"] for row in rows),
                "rounds": rows,
            }
            print(json.dumps({config: results[f"{config}/{length}"]["median"]}), flush=True)
    return results


def one_turn(address: str, prompt: str, args) -> tuple[float, str]:
    """TTFT and text of one greedy generation through the gateway."""
    sent, first, pieces = time.perf_counter(), None, []
    for response in client.generate(address, prompt, max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True):
        if response.HasField("chunk"):
            if first is None and any(d.token_ids for d in response.chunk.choices):
                first = time.perf_counter() - sent
            pieces += [d.text for d in response.chunk.choices]
    return first, "".join(pieces)


def run_mesh(args) -> dict:
    """Both meshes up at once; every turn goes to one and then the other (the order alternating), so the
    machine's drift hits both alike. Greedy answers are equal, so the histories stay equal too."""
    pool = str(args.pool_blocks * 2 * 30 * 16 * 3 * 64 * 4)  # float32 blocks of SmolLM2, so the engines are float32
    rng = random.Random(0)
    words = "paged attention block cache store prefix token engine request memory layer model the a of".split()
    histories = ["" for _ in range(args.conversations)]
    ttft = {"store": [[] for _ in range(args.turns)], "no_store": [[] for _ in range(args.turns)]}
    identical = True
    with (
        Mesh(EngineArgs(dtype="float32", kv_cache_memory=pool), kv_store=True) as store,
        Mesh(EngineArgs(dtype="float32", kv_cache_memory=pool)) as plain,
    ):
        meshes = {"store": store.address, "no_store": plain.address}
        started = time.perf_counter()
        for turn in range(args.turns):
            for c in range(args.conversations):
                user = " ".join(rng.choice(words) for _ in range(args.user_words))
                histories[c] += f"\nUser {c}: {user}\nAssistant:"
                order = ("store", "no_store") if (turn + c) % 2 == 0 else ("no_store", "store")
                texts = {}
                for variant in order:
                    seconds, texts[variant] = one_turn(meshes[variant], histories[c], args)
                    ttft[variant][turn].append(seconds)
                identical &= texts["store"] == texts["no_store"]
                histories[c] += texts["store"]
            print(
                f"turn {turn + 1}: median TTFT with the store {statistics.median(ttft['store'][turn]) * 1000:.0f} ms, "
                f"without {statistics.median(ttft['no_store'][turn]) * 1000:.0f} ms",
                flush=True,
            )
        total = time.perf_counter() - started
    per_turn = [
        statistics.median(n / s for s, n in zip(ttft["store"][t], ttft["no_store"][t])) for t in range(args.turns)
    ]
    return {
        "ttft_s": ttft,
        "median_paired_ratio_no_store_over_store_per_turn": per_turn,
        "identical_outputs": identical,
        "prompt_tokens_last_turn_chars": max(map(len, histories)),
        "total_s": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-mesh", action="store_true")
    parser.add_argument("--skip-reload", action="store_true")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-words", type=int, default=120)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--pool-blocks", type=int, default=96)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    make_credentials(tls.default_tls_dir())  # the mesh's, as `llmmesh serve` makes them on first start
    report = {
        "machine": f"{platform.node()} {platform.machine()}, {__import__('os').cpu_count()} cores",
        "args": vars(args),
    }
    if not args.skip_ttft:
        report["ttft"] = run_ttft(args)
    if not args.skip_reload:
        report["reload"] = run_reload(args)
    if not args.skip_mesh:
        report["mesh"] = run_mesh(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
