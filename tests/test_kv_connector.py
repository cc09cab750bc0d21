"""The engine's KV connectors against real stores: the kvstore on a real redis-server, and SharedStorageConnector's
directory. Greedy output identical to Hugging Face with blocks loaded from the store instead of computed, counters
that show the reuse (each request counted once), fingerprint isolation, corruption, a connector plugged in by module
path; for the kvstore also faults (Redis or the kvstore killed or frozen, eviction under maxmemory), a slow lookup
that does not stall the step, abort and preemption during transfers, KV events, and loads through shared memory
(in segments smaller than a load, as bytes when the kvstore cannot map it)."""

import contextlib
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import redis

from conftest import (
    InProcessService,
    assert_greedy_matches,
    assert_no_leaks,
    loading_kv_config,
    mesh_channel,
    run_greedy,
    wait_for_health,
)
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.kv.block_pool import BlockStored
from engine.kv.connector.base import KVTransferConfig
from engine.kv.connector.factory import get_connector_class
from engine.kv.connector.shared_storage_connector import SharedStorageConnector, parse_extra_config
from engine.request import Request, RequestStatus, SamplingParams
from mesh.shared_memory import SHM_DIR
from services.local_mesh import kv_transfer_config
from services.service_process import ServiceProcess

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
# One SmolLM2 block of 16 tokens in float32: K and V of 30 layers, 3 KV heads of 64.
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def pool(num_blocks: int) -> str:
    return str(num_blocks * BLOCK_BYTES)


def make_engine(address: str, connector_options=None, **args) -> EngineCore:
    args.setdefault("kv_cache_memory", "64MiB")
    options = {"load_policy": "always", **(connector_options or {})}
    return EngineCore(EngineArgs(kv_transfer_config=kv_transfer_config(address, **options), **args))


def settle(engine: EngineCore) -> None:
    """Step until every transfer has ended (stores hold their blocks until then)."""
    while engine.has_unfinished_requests():
        engine.step()


def connector_stats(engine: EngineCore) -> dict:
    return engine.get_stats().kv_connector_stats


def shared_storage_config(path) -> str:
    return json.dumps(
        {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": str(path)}}
    )


@dataclass
class Store:
    """A connector's --kv-transfer-config, and the stored bytes of a block (by hash) read and written in place."""

    config: str
    read: Callable[[bytes], bytes | None]
    write: Callable[[bytes, bytes], None]

    def engine(self, **args) -> EngineCore:
        args.setdefault("kv_cache_memory", "64MiB")
        return EngineCore(EngineArgs(kv_transfer_config=self.config, **args))


@pytest.fixture(params=["KVStoreConnector", "SharedStorageConnector"])
def store(request, tmp_path) -> Store:
    """Each connector over a store of its own: the kvstore on a fresh Redis, or a fresh directory."""
    if request.param == "KVStoreConnector":
        address = request.getfixturevalue("kvstore").address
        client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)

        def key(block_hash):
            keys = client.keys(f"kv:*:{block_hash.hex()}")
            return keys[0] if keys else None

        return Store(
            loading_kv_config(address),
            lambda h: client.get(key(h)) if key(h) else None,
            lambda h, data: client.set(key(h), data),
        )

    def path(block_hash):
        paths = list(tmp_path.glob(f"*/{block_hash.hex()}"))
        return paths[0] if paths else None

    return Store(
        shared_storage_config(tmp_path),
        lambda h: path(h).read_bytes() if path(h) else None,
        lambda h, data: path(h).write_bytes(data),
    )


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = [
        "The history of paged memory in operating systems begins with the Atlas computer, which " * 4,
        "def merge_sort(items):\n    \"\"\"Sort a list with merge sort, returning a new list.\"\"\"\n" * 4,
        "Three reasons why the night sky is dark, explained for a curious child: " * 5,
    ]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def references(hf_smollm2, prompts):
    return [hf_smollm2.greedy(p, MAX_TOKENS) for p in prompts]


def assert_all_match(outputs, references, label):
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outputs, references)):
        assert_greedy_matches(ours, ref_tokens, ref_logits, f"{label} prompt {i}")


@pytest.fixture
def kvstore(redis_server):
    with InProcessService("kvstore", ["--redis-url", redis_server.url]) as service:
        yield service


def test_reload_after_reset_and_on_a_second_engine_matches_hf(store, prompts, references):
    first = store.engine()
    assert_all_match(run_greedy(first, prompts, MAX_TOKENS), references, "cold")
    settle(first)
    stats = connector_stats(first)
    full_blocks = sum(len(p) // 16 for p in prompts)
    assert stats["stored_blocks"] == full_blocks and stats["loaded_tokens"] == 0

    # The local prefix cache is gone; the store still has every prompt block.
    assert first.reset_prefix_cache()
    assert_all_match(run_greedy(first, prompts, MAX_TOKENS), references, "reload")
    stats = connector_stats(first)
    # Every full block but the one holding the last prompt token came from the store: prefill that did not run.
    expected = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert stats["loaded_tokens"] == expected and stats["load_failed_tokens"] == 0
    assert first.get_stats().prefix_cache_hits == 0
    # The loaded blocks joined the local prefix cache: the same prompts now hit it.
    settle(first)
    assert_all_match(run_greedy(first, prompts, MAX_TOKENS), references, "local after reload")
    assert first.get_stats().prefix_cache_hits == expected
    assert connector_stats(first)["loaded_tokens"] == expected
    settle(first)
    assert_no_leaks(first)

    # A second engine (its own pool, same store) loads what the first computed.
    second = store.engine()
    assert_all_match(run_greedy(second, prompts, MAX_TOKENS), references, "second engine")
    assert connector_stats(second)["loaded_tokens"] == expected
    assert connector_stats(second)["stored_blocks"] == 0  # all there already
    settle(second)
    assert_no_leaks(second)
    first.shutdown()
    second.shutdown()


def test_small_pool_and_chunked_prefill_match_hf(store, prompts, references):
    """A pool far smaller than the prompts together (evictions), prompts prefilled in 48-token chunks."""
    producer = store.engine(max_num_batched_tokens=48)
    assert_all_match(run_greedy(producer, prompts, MAX_TOKENS), references, "chunked cold")
    settle(producer)
    assert connector_stats(producer)["stored_blocks"] == sum(len(p) // 16 for p in prompts)
    # 12 blocks of 16 tokens: one prompt at a time fits, the three together do not.
    consumer = store.engine(kv_cache_memory=pool(12), max_num_batched_tokens=48)
    assert consumer.num_blocks == 12
    assert_all_match(run_greedy(consumer, prompts, MAX_TOKENS), references, "small pool")
    assert connector_stats(consumer)["loaded_tokens"] > 0
    settle(consumer)
    assert_no_leaks(consumer)
    producer.shutdown()
    consumer.shutdown()


@pytest.mark.parametrize("segment", ["2 blocks", "declined", "off"])
def test_loads_through_shared_memory_or_as_bytes_match_hf(kvstore, prompts, references, segment):
    """The kvstore writes loads into the engine's segment (2 blocks here: a load takes several Gets), and the engine
    unlinks its name once the kvstore has it mapped. A segment the kvstore cannot map (not private) is declined:
    loads come as bytes, and the engine stops offering one; shared_memory_bytes 0 offers none."""
    size = {"2 blocks": 2 * BLOCK_BYTES, "declined": 64 * BLOCK_BYTES, "off": 0}[segment]
    engine = make_engine(kvstore.address, {"shared_memory_bytes": size})
    assert_all_match(run_greedy(engine, prompts, MAX_TOKENS), references, "cold")
    settle(engine)
    worker_side = engine.worker.connector
    if segment == "declined":
        staging = worker_side._staging()
        os.chmod(os.path.join(SHM_DIR, staging.name), 0o640)
    assert engine.reset_prefix_cache()
    assert_all_match(run_greedy(engine, prompts, MAX_TOKENS), references, f"reload, {segment}")
    expected = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert connector_stats(engine)["loaded_tokens"] == expected
    if segment == "2 blocks":
        staging = worker_side.staging
        assert staging.num_blocks == 2 and staging.taken and not staging.linked
        assert not os.path.exists(os.path.join(SHM_DIR, staging.name))
    else:
        assert worker_side.staging is None and worker_side.staging_blocks == 0
    if segment == "declined":
        assert not os.path.exists(os.path.join(SHM_DIR, staging.name))
    settle(engine)
    assert_no_leaks(engine)
    engine.shutdown()


def test_fingerprint_isolation(store, prompts):
    """Same store, same prompts: an engine with another dtype or block size finds nothing to load."""
    producer = store.engine()
    run_greedy(producer, prompts[:1], 2)
    settle(producer)
    for args in ({"dtype": "bfloat16"}, {"block_size": 32}):
        other = store.engine(**args)
        run_greedy(other, prompts[:1], 2)
        stats = connector_stats(other)
        assert stats["lookup_hit_tokens"] == 0 and stats["loaded_tokens"] == 0, args
        other.shutdown()
    # The producer's own twin does find them.
    twin = store.engine()
    run_greedy(twin, prompts[:1], 2)
    assert connector_stats(twin)["loaded_tokens"] > 0
    producer.shutdown()
    twin.shutdown()


def test_corrupt_block_is_dropped_and_recomputed(store, prompts, references):
    engine = store.engine()
    run_greedy(engine, prompts[:1], MAX_TOKENS)
    settle(engine)
    engine.reset_prefix_cache()
    # Flip one byte in the payload of the prompt's third block, where the store keeps it.
    block_hash = engine_request_hashes(engine, prompts[0])[2]
    value = bytearray(store.read(block_hash))
    value[-100] ^= 0xFF
    store.write(block_hash, bytes(value))

    assert_all_match(run_greedy(engine, prompts[:1], MAX_TOKENS), references[:1], "after corruption")
    stats = connector_stats(engine)
    assert stats["loaded_tokens"] == 2 * 16  # the two blocks before the corrupt one
    assert stats["load_failed_tokens"] > 0  # the rest was recomputed
    assert store.read(block_hash) != bytes(value)  # dropped (the recompute may store it again)
    settle(engine)
    assert_no_leaks(engine)
    engine.shutdown()


def engine_request_hashes(engine, prompt):
    from engine.kv.hashing import update_block_hashes

    request = Request("hashes", prompt, SamplingParams(max_tokens=1))
    manager = engine.kv_cache_manager
    update_block_hashes(request, manager.block_size, manager.hash_fn, manager.root_hash)
    return request.block_hashes


def test_redis_killed_and_back(redis_server, prompts, references):
    """Redis dies mid-run: every request completes with the same output (recomputed); once Redis is back the
    engine stores and loads again."""
    with InProcessService("kvstore", ["--redis-url", redis_server.url]) as kvstore:
        engine = make_engine(kvstore.address, {"retry_interval_s": 0.2})
        run_greedy(engine, prompts[:1], MAX_TOKENS)
        settle(engine)
        redis_server.kill()
        engine.reset_prefix_cache()
        assert_all_match(run_greedy(engine, prompts, MAX_TOKENS), references, "redis down")
        assert connector_stats(engine)["loaded_tokens"] == 0
        settle(engine)
        assert_no_leaks(engine)

        redis_server.start()  # empty, same port
        wait_for_health(kvstore.address)
        wait_until_store_reachable(engine)
        stored_before = connector_stats(engine)["stored_blocks"]
        engine.reset_prefix_cache()
        run_greedy(engine, prompts[:1], 1)
        settle(engine)
        assert connector_stats(engine)["stored_blocks"] > stored_before
        engine.reset_prefix_cache()
        assert_all_match(run_greedy(engine, prompts[:1], MAX_TOKENS), references[:1], "redis back")
        assert connector_stats(engine)["loaded_tokens"] > 0
        settle(engine)
        assert_no_leaks(engine)
        engine.shutdown()


def wait_until_store_reachable(engine):
    """Block until both connector halves are connected to the store again and past their back-off after the
    fault (events: the channel becoming ready, the clock reaching a time)."""
    import threading
    import time

    import grpc

    for connector in (engine.connector, engine.worker.connector):
        grpc.channel_ready_future(connector.client.channel).result(timeout=60)
        delay = connector.down_until - time.monotonic()
        if delay > 0:
            threading.Event().wait(delay)


def test_kvstore_killed_mid_run_and_back(redis_server, prompts, references):
    kvstore = ServiceProcess("kvstore", ["--port", "0", "--redis-url", redis_server.url])
    address = kvstore.wait_listening(120)
    try:
        engine = make_engine(address, {"retry_interval_s": 0.2, "timeout_s": 5})
        run_greedy(engine, prompts[:2], MAX_TOKENS)
        settle(engine)
        kvstore.kill()
        engine.reset_prefix_cache()
        assert_all_match(run_greedy(engine, prompts, MAX_TOKENS), references, "kvstore down")
        settle(engine)
        assert_no_leaks(engine)

        port = kvstore.port
        kvstore = ServiceProcess("kvstore", ["--port", str(port), "--redis-url", redis_server.url])
        kvstore.wait_listening(120)
        wait_for_health(address)
        engine.reset_prefix_cache()
        wait_until_store_reachable(engine)
        # Redis kept the blocks: loads resume.
        assert_all_match(run_greedy(engine, prompts[:2], MAX_TOKENS), references[:2], "kvstore back")
        assert connector_stats(engine)["loaded_tokens"] > 0
        settle(engine)
        assert_no_leaks(engine)
        engine.shutdown()
    finally:
        kvstore.kill()


def test_eviction_under_maxmemory(prompts, references):
    """Redis with room for a few blocks only: it evicts as blocks arrive; loads find short runs or none, and
    every output is unchanged."""
    from services.redis_server import RedisServer

    with RedisServer(maxmemory="3mb") as small, InProcessService("kvstore", ["--redis-url", small.url]) as kvstore:
        engine = make_engine(kvstore.address)
        assert_all_match(run_greedy(engine, prompts, MAX_TOKENS), references, "cold")
        settle(engine)
        engine.reset_prefix_cache()
        assert_all_match(run_greedy(engine, prompts, MAX_TOKENS), references, "evicted")
        info = redis.Redis.from_url(small.url).info("stats")
        assert info["evicted_keys"] > 0
        loaded = connector_stats(engine)["loaded_tokens"]
        assert loaded < sum((len(p) - 1) // 16 * 16 for p in prompts)
        settle(engine)
        assert_no_leaks(engine)
        engine.shutdown()


def start_running(engine: EngineCore, prompt) -> None:
    """Add a request "running" that decodes for 50 steps, and step until it does."""
    running = Request("running", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request(running)
    while running.status != RequestStatus.RUNNING:
        engine.step()


def test_abort_during_load_and_preemption_during_stores(kvstore, prompts, references, tokenizer):
    long_prompt = tokenizer.encode("Paged attention splits the KV cache into fixed-size blocks. " * 120)
    engine = make_engine(kvstore.address, kv_cache_memory="128MiB")
    run_greedy(engine, [long_prompt], 1)
    settle(engine)
    engine.reset_prefix_cache()

    # A lookup and a load do not hold up the batch: in the steps that wait for them, a running request still gets
    # its token.
    start_running(engine, prompts[2])
    loads = Request("loads", long_prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.add_request(loads)
    while loads.status == RequestStatus.WAITING and loads.num_computed_tokens == 0:
        outputs = engine.step()
        assert [o.request_id for o in outputs if o.new_token_ids] == ["running"]
    settle(engine)
    assert connector_stats(engine)["loaded_tokens"] == (len(long_prompt) - 1) // 16 * 16
    engine.reset_prefix_cache()

    # Abort while its lookup is out: the request ends at once, and its answer is dropped.
    engine.add_request(Request("w", long_prompt, SamplingParams(temperature=0, max_tokens=4)))
    engine.step()
    assert engine.scheduler.requests["w"].status == RequestStatus.WAITING and engine.connector.lookups
    engine.abort_requests(["w"])
    assert not engine.has_request("w") and not engine.connector.lookups

    # Abort while the load is in flight: alone, the request parks in WAITING_FOR_REMOTE_KVS once its lookup is in.
    request = Request("a", long_prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.add_request(request)
    while request.status == RequestStatus.WAITING:
        engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_requests(["a"])
    assert engine.has_request("a")  # its blocks are still being written: the id stays taken until the load ends
    settle(engine)
    assert not engine.has_request("a")
    assert_no_leaks(engine)

    # Abort right after the step that computed the prompt: its stores still hold (and read) its blocks.
    engine.reset_prefix_cache()
    engine.add_request(Request("b", prompts[1], SamplingParams(temperature=0, max_tokens=4)))
    engine.step()
    assert engine.connector.has_pending_transfers() or connector_stats(engine)["stored_blocks"] > 0
    engine.abort_requests(["b"])
    settle(engine)
    assert_no_leaks(engine)

    # Preemption while stores hold blocks (decode blocks stored too): 10 blocks for three requests of 4-6 blocks.
    small = make_engine(kvstore.address, {"store_decode_blocks": True}, kv_cache_memory=pool(10))
    short = [p[:60] for p in prompts]
    outputs = run_greedy(small, short, 24)
    assert small.get_stats().num_preemptions > 0
    reference = run_greedy(make_engine(kvstore.address, {"load_policy": "never"}), short, 24)
    assert outputs == reference
    settle(small)
    assert_no_leaks(small)
    engine.shutdown()
    small.shutdown()


def test_kv_events_name_the_store(kvstore, prompts):
    engine = make_engine(kvstore.address, enable_kv_cache_events=True)
    run_greedy(engine, prompts[:1], 2)
    settle(engine)
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"device", "kvstore"}
    assert sum(len(e.block_hashes) for e in stored if e.medium == "kvstore") == len(prompts[0]) // 16
    engine.reset_prefix_cache()
    engine.take_kv_events()
    run_greedy(engine, prompts[:1], 2)
    events = engine.take_kv_events()
    loaded = [e for e in events if isinstance(e, BlockStored) and e.loaded_from == "kvstore"]
    assert sum(len(e.block_hashes) for e in loaded) == (len(prompts[0]) - 1) // 16
    engine.shutdown()

    # On VllmEngine's wire (SubscribeKvEvents): blocks in the store are the EXTERNAL tier; loaded ones DEVICE.
    from smg_grpc_proto.generated import common_pb2 as smg_common_pb2

    from services.vllm_convert import kv_events_to_vllm

    wire = kv_events_to_vllm(1, 0.0, stored + loaded)
    tiers = {(e.stored.tier, e.stored.medium) for e in wire.events}
    assert tiers == {
        (smg_common_pb2.KV_CACHE_TIER_DEVICE, "device"),
        (smg_common_pb2.KV_CACHE_TIER_EXTERNAL, "kvstore"),
        (smg_common_pb2.KV_CACHE_TIER_DEVICE, "device;loaded_from=kvstore"),
    }


def test_two_engines_behind_one_gateway_share_the_store(prompts):
    """`llmmesh serve`'s processes with two engine replicas and the store: whichever engine the gateway picks
    computes the prompt; the other then finds its whole prefix in the store (cached tokens it never computed)."""

    from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
    from services import client
    from services.local_mesh import Mesh

    prompt = prompts[0]
    num_full = (len(prompt) - 1) // 16 * 16
    with Mesh(EngineArgs(kv_cache_memory="64MiB"), kv_store=True, num_engines=2) as mesh:
        through_gateway = client.collect(client.generate(mesh.address, prompt, max_tokens=MAX_TOKENS, temperature=0.0))
        assert through_gateway.complete.usage.cached_tokens == 0
        with mesh_channel(mesh.services["kvstore"].address) as channel:
            stats = kvstore_pb2_grpc.KVStoreStub(channel).Stats
            # The stores run after the step that computed the blocks: wait for them (bounded, not timed).
            for reply in iter(lambda: stats(kvstore_pb2.StatsRequest(), timeout=10), None):
                if reply.blocks_stored >= len(prompt) // 16:
                    break
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for name in mesh.engine_names:
            with mesh_channel(mesh.services[name].address) as channel:
                request = engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=params)
                messages = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=120))
            tokens = [t for m in messages for d in m.outputs for t in d.token_ids]
            assert tokens == list(through_gateway.token_ids[0]), name
            # One engine hits its own prefix cache, the other loads from the store: the same count either way.
            assert messages[-1].usage.cached_tokens == num_full, name


def test_frozen_kvstore_costs_a_deadline_not_a_hang(redis_server, prompts, references):
    """A kvstore that stops answering (SIGSTOP): lookups and loads run into their deadlines and the requests are
    recomputed, with the same output; after SIGCONT the engine loads again."""
    kvstore = ServiceProcess("kvstore", ["--port", "0", "--redis-url", redis_server.url])
    address = kvstore.wait_listening(120)
    try:
        engine = make_engine(address, {"lookup_timeout_s": 0.3, "timeout_s": 1.0, "retry_interval_s": 0.2})
        run_greedy(engine, prompts[:1], MAX_TOKENS)
        settle(engine)
        engine.reset_prefix_cache()
        kvstore.popen.send_signal(signal.SIGSTOP)
        assert_all_match(run_greedy(engine, prompts, MAX_TOKENS), references, "kvstore frozen")
        settle(engine)
        assert_no_leaks(engine)
        kvstore.popen.send_signal(signal.SIGCONT)
        wait_for_health(address)
        engine.reset_prefix_cache()
        wait_until_store_reachable(engine)
        loaded_before = connector_stats(engine)["loaded_tokens"]
        assert_all_match(run_greedy(engine, prompts[:1], MAX_TOKENS), references[:1], "kvstore thawed")
        assert connector_stats(engine)["loaded_tokens"] > loaded_before
        engine.shutdown()
    finally:
        kvstore.popen.send_signal(signal.SIGCONT)
        kvstore.kill()


def test_engine_info_carries_the_connector_figures(kvstore, prompts):
    """The services read the connector through EngineInfo: its role, its layout, its typed stats with the load
    cost the kvstore connector estimates (GetLoad's kv_load_cost)."""
    engine = make_engine(kvstore.address)
    run_greedy(engine, prompts[:1], 2)
    settle(engine)
    info = engine.update_info()
    assert info.kv_role == "kv_both" and list(info.kv_layouts) == engine.connector.layouts
    assert info.kv_connector_stats.data == connector_stats(engine)
    assert info.kv_connector_stats.block_load_cost == engine.connector.cost.block_load_cost() is not None
    assert engine.update_info() is info  # nothing changed since
    engine.shutdown()


def test_load_or_recompute_follows_the_estimate(kvstore, prompts):
    """load_policy auto: with the measured prefill rate of a fast accelerator, loading no longer pays and the
    prefix is recomputed; with this CPU's own measurements, it loads."""
    engine = make_engine(kvstore.address, {"load_policy": "auto"})
    run_greedy(engine, prompts[:1], 2)
    settle(engine)
    engine.reset_prefix_cache()
    cost = engine.connector.cost
    assert cost.prefill_rate is not None  # measured from the first prefill
    measured = cost.prefill_rate
    cost.prefill_rate = 1e9  # tokens/s: recomputing is all but free
    run_greedy(engine, prompts[:1], 2)
    stats = connector_stats(engine)
    assert stats["loaded_tokens"] == 0 and stats["recompute_chosen_tokens"] == (len(prompts[0]) - 1) // 16 * 16
    settle(engine)
    engine.reset_prefix_cache()
    cost.prefill_rate = measured
    run_greedy(engine, prompts[:1], 2)
    assert connector_stats(engine)["loaded_tokens"] == (len(prompts[0]) - 1) // 16 * 16
    settle(engine)
    engine.shutdown()


def test_request_metrics_carry_the_kv_transfers(store, prompts):
    """What a trace shows of the store: a request's stores, and its load (asked and arrived), with token counts."""
    from engine import LLM

    llm = LLM(kv_cache_memory="64MiB", kv_transfer_config=store.config)
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    full = len(prompts[0]) // 16 * 16
    assert [(name, n) for _, name, n in first.metrics.kv_transfers] == [("kv_store_started", full)]
    settle(llm.engine)
    assert llm.reset_prefix_cache()
    again = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    loaded = (len(prompts[0]) - 1) // 16 * 16
    names = [(name, n) for _, name, n in again.metrics.kv_transfers]
    assert names[:2] == [("kv_load_started", loaded), ("kv_loaded", loaded)]
    llm.engine.shutdown()


def test_request_retried_for_many_steps_is_looked_up_and_counted_once(store, prompts, references):
    """A request whose load the pool cannot take yet is tried on every step until it can: the store is asked once,
    and its lookup and its prefix-cache query are each counted once."""
    engine = store.engine(kv_cache_memory=pool(8))
    run_greedy(engine, prompts[:1], 1)
    settle(engine)
    assert engine.reset_prefix_cache()
    before_stats, before = connector_stats(engine), engine.get_stats()
    # 6 of the 8 blocks, 7 as it decodes; prompt 0's load needs 4 more blocks than that leaves.
    engine.add_request(Request("hog", prompts[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    while engine.scheduler.requests["hog"].status != RequestStatus.RUNNING:
        engine.step()
    retried = Request("retried", prompts[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.add_request(retried)
    tokens, tries = [], 0
    while engine.has_unfinished_requests():
        tries += retried.status == RequestStatus.WAITING
        tokens += [t for out in engine.step() if out.request_id == "retried" for t in out.new_token_ids]
    assert tries >= 5
    assert_all_match([tokens], references[:1], "retried")
    stats, after = connector_stats(engine), engine.get_stats()
    counted = {key: stats[key] - before_stats[key] for key in ("lookups", "lookup_tokens", "loaded_tokens")}
    lookup_tokens = ((len(prompts[1]) - 1) // 16 + (len(prompts[0]) - 1) // 16) * 16
    assert counted == {"lookups": 2, "lookup_tokens": lookup_tokens, "loaded_tokens": (len(prompts[0]) - 1) // 16 * 16}
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(prompts[1]) + len(prompts[0])
    assert_no_leaks(engine)
    engine.shutdown()


@contextlib.contextmanager
def freezable_store_with(redis_server, prompt):
    """A kvstore process of its own (a test freezes it with SIGSTOP) and an engine whose Lookups may take a minute,
    with prompt's blocks in the store and not in the engine's cache: (kvstore, engine)."""
    kvstore = ServiceProcess("kvstore", ["--port", "0", "--redis-url", redis_server.url])
    try:
        address = kvstore.wait_listening(120)
        # A deadline far longer than the test: had a step waited for the answer, the load would still happen, but
        # only after that step had sat out the whole freeze.
        engine = make_engine(address, {"lookup_timeout_s": 60})
        run_greedy(engine, [prompt], 1)
        settle(engine)
        engine.reset_prefix_cache()
        yield kvstore, engine
        engine.shutdown()
    finally:
        kvstore.popen.send_signal(signal.SIGCONT)
        kvstore.kill()


def test_slow_lookup_does_not_stall_the_step(redis_server, prompts, tokenizer):
    """A kvstore that stops answering (SIGSTOP) while a request's Lookup is out: steps go on for the running request
    and for a request admitted behind the one waiting on its answer; once the store answers, the request loads."""
    with freezable_store_with(redis_server, prompts[0]) as (kvstore, engine):
        start_running(engine, prompts[2])
        settle_stores(engine)
        lookups = connector_stats(engine)["lookups"]
        kvstore.popen.send_signal(signal.SIGSTOP)
        loads = Request("loads", prompts[0], SamplingParams(temperature=0, max_tokens=2))
        engine.add_request(loads)
        short = Request("short", tokenizer.encode("Hello there"), SamplingParams(temperature=0, max_tokens=8))
        engine.add_request(short)
        emitted = []
        for _ in range(4):
            emitted += [o.request_id for o in engine.step() if o.new_token_ids]
        assert emitted.count("running") == 4 and emitted.count("short") == 4
        assert loads.status == RequestStatus.WAITING
        assert connector_stats(engine)["lookups"] == lookups  # its answer is not in
        kvstore.popen.send_signal(signal.SIGCONT)
        while engine.has_request("loads"):
            engine.step()
        stats = connector_stats(engine)
        assert stats["lookups"] == lookups + 1 and stats["loaded_tokens"] == (len(prompts[0]) - 1) // 16 * 16
        settle(engine)
        assert_no_leaks(engine)


def test_a_step_with_nothing_to_run_waits_on_the_lookup_not_on_transfers(redis_server, prompts):
    """The only request waits on its Lookup: the step that runs nothing waits for that answer (IDLE_WAIT_S at most,
    the store frozen here) and tells the worker not to add its own idle wait; once the answer is in, the request
    loads, and with no Lookup in flight the worker waits for transfers again."""
    with freezable_store_with(redis_server, prompts[0]) as (kvstore, engine):
        worker_side = engine.worker.connector
        kvstore.popen.send_signal(signal.SIGSTOP)
        loads = Request("loads", prompts[0], SamplingParams(temperature=0, max_tokens=2))
        engine.add_request(loads)
        for _ in range(3):
            engine.step()
            assert loads.status == RequestStatus.WAITING and not worker_side.idle_wait
        kvstore.popen.send_signal(signal.SIGCONT)
        settle(engine)
        assert worker_side.idle_wait  # no Lookup in flight: the worker waits for transfers again
        assert connector_stats(engine)["loaded_tokens"] == (len(prompts[0]) - 1) // 16 * 16
        assert_no_leaks(engine)


def settle_stores(engine: EngineCore) -> None:
    """Step until the stores in flight have ended (each holds its blocks until then)."""
    while engine.connector.store_holds:
        engine.step()


class LocalDiskConnector(SharedStorageConnector):
    """A connector the engine does not know by name: it comes in through kv_connector_module_path."""


def test_connector_from_kv_connector_module_path_needs_no_engine_edit(tmp_path, prompts, references):
    """vLLM's kv_connector_module_path: a connector class defined outside the engine (here, in this test module) runs
    both halves, loads what it stored, and matches Hugging Face; the core, scheduler and worker name no connector."""
    config = json.dumps(
        {
            "kv_connector": "LocalDiskConnector",
            "kv_connector_module_path": __name__,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        }
    )
    engine = EngineCore(EngineArgs(kv_cache_memory="64MiB", kv_transfer_config=config))
    assert type(engine.connector) is LocalDiskConnector and type(engine.worker.connector) is LocalDiskConnector
    assert_all_match(run_greedy(engine, prompts[:1], MAX_TOKENS), references[:1], "cold")
    assert engine.reset_prefix_cache()
    assert_all_match(run_greedy(engine, prompts[:1], MAX_TOKENS), references[:1], "loaded")
    assert connector_stats(engine)["loaded_tokens"] == (len(prompts[0]) - 1) // 16 * 16
    assert_no_leaks(engine)
    engine.shutdown()


def test_kv_transfer_config_names_the_field_at_fault():
    def config(**fields):
        return KVTransferConfig.from_json(json.dumps(fields))

    with pytest.raises(ValueError, match="kv_connector must be one of .*KVStoreConnector.*kv_connector_module_path"):
        config(kv_connector="NoSuchConnector")
    with pytest.raises(ValueError, match="kv_connector_module_path"):
        get_connector_class(config(kv_connector="X", kv_connector_module_path="no_such_module_anywhere"))
    with pytest.raises(ValueError, match="'Store' is no KVConnectorBase subclass"):
        get_connector_class(config(kv_connector="Store", kv_connector_module_path=__name__))
    assert (
        get_connector_class(config(kv_connector="LocalDiskConnector", kv_connector_module_path=__name__))
        is LocalDiskConnector
    )
    with pytest.raises(ValueError, match="shared_storage_path must be a directory"):
        parse_extra_config(config(kv_connector="SharedStorageConnector"))
