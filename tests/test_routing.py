"""KV-cache-aware routing (services/routing.py): the index of the engines' KV events, its bound, the policy, the
gateway's block hashes against the engine's, and a mesh of two engines (a tiny random model) under conversations
that share a system prompt: where each turn lands, the hit rate against least-loaded, and an engine restarted
mid-run."""

import asyncio
import contextlib
import io
import json
import os
import random
import signal
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from test_serve import SERVING_LINE, Serve

from conftest import (
    HFReference,
    InProcessService,
    assert_greedy_matches,
    mesh_channel,
    mesh_credentials_of,
    wait_until,
)
from engine.config import EngineArgs
from engine.limits import RequestLimits
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from random_model import save_random_smollm2_shaped
from services import client
from services.dependencies import HEALTH_MISSES, Dependencies
from services.gateway import Gateway
from services.local_mesh import Mesh
from services.routing import (
    INDEX_ENTRY_BYTES,
    STORE,
    STORE_LOAD_TRIP_BLOCKS,
    EngineLoad,
    KVBlockIndex,
    Router,
    engine_cost,
)
from services.service_process import free_port
from test_models import COMMON

# A tiny Llama: conversations of a few hundred tokens, and a LONG_TOKENS generation.
TINY = {**COMMON, "max_position_embeddings": 8192}
BLOCK = 16
MAX_TOKENS = 8
# A generation still decoding when an engine is killed: seconds long (1500 tokens took 0.5 s on one core, and once
# ended before the kill landed).
LONG_TOKENS = 6000
# Conversations: a shared system prompt, then per conversation its own document, then short follow-ups.
SYSTEM_TOKENS, DOCUMENT_TOKENS, FOLLOW_UP_TOKENS = 48, 160, 16
NUM_CONVERSATIONS, NUM_TURNS = 3, 4  # an odd number: least-loaded's turns do not line up with them


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def batch(seq: int, *events) -> engine_pb2.KvEventBatch:
    return engine_pb2.KvEventBatch(sequence_number=seq, events=list(events))


def stored(hashes, medium="device", loaded_from="") -> engine_pb2.KvEvent:
    block = engine_pb2.BlockStored(block_hashes=hashes, block_size=BLOCK, medium=medium, loaded_from=loaded_from)
    return engine_pb2.KvEvent(stored=block)


def removed(hashes) -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(removed=engine_pb2.BlockRemoved(block_hashes=hashes))


CLEARED = engine_pb2.KvEvent(cleared=engine_pb2.AllBlocksCleared())


# ---- the index and the policy ---------------------------------------------------------------------------


def test_index_follows_events_lost_duplicated_and_late():
    index = KVBlockIndex(num_engines=2)
    chain = [h(i) for i in range(6)]
    index.apply(0, batch(1, stored(chain[:4])))
    assert index.match(chain) == [(4, 0), (0, 0)]
    # The same batch again (duplicated): nothing changes.
    index.apply(0, batch(1, stored(chain[:4])))
    assert index.match(chain) == [(4, 0), (0, 0)] and len(index) == 4
    # Engine 1 stored the first three to the kvstore: every engine can load them.
    index.apply(1, batch(1, stored(chain[:3], medium="kvstore")))
    assert index.match(chain) == [(4, 0), (0, 3)]
    # Engine 0 evicted block 1: its prefix stops at 1 block, and blocks 1..2 are still in the store.
    index.apply(0, batch(2, removed([chain[1]])))
    assert index.match(chain) == [(1, 2), (0, 3)]
    # A late removal of what is gone, or of what was never stored (a lost BlockStored): nothing breaks.
    index.apply(0, batch(3, removed([chain[1], h(99)])))
    assert index.match(chain) == [(1, 2), (0, 3)]
    # Engine 1 loaded blocks 0..2 from the store into its cache.
    index.apply(1, batch(2, stored(chain[:3], loaded_from="kvstore")))
    assert index.match(chain) == [(1, 2), (3, 0)]
    # Engine 0 restarted (AllBlocksCleared): its entries go; the store's and engine 1's stay.
    index.apply(0, batch(4, CLEARED))
    assert index.match(chain) == [(0, 3), (3, 0)]
    assert index.blocks[chain[0]] == STORE | 1 << 2
    index.drop_engine(1)  # its KV event stream ended
    assert index.match(chain) == [(0, 3), (0, 3)]
    assert all(mask == STORE for mask in index.blocks.values())


def test_index_flooded_stays_within_its_bound():
    """Ten times more hashes than the cap, from two engines and the store: at most max_blocks entries, the newest
    kept, and the memory within max_blocks * INDEX_ENTRY_BYTES."""
    cap = 2000
    index = KVBlockIndex(num_engines=2, max_blocks=cap)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq in range(1, 101):
            first = seq * 200
            hashes = [h(i) for i in range(first, first + 200)]
            index.apply(seq % 2, batch(seq, stored(hashes, medium="kvstore" if seq % 3 == 0 else "device")))
            assert len(index) <= cap
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == cap
    assert grown <= cap * INDEX_ENTRY_BYTES, f"{grown} bytes for {cap} entries"
    newest = [h(i) for i in range(100 * 200, 101 * 200)]
    assert index.match(newest)[0] == (200, 0)  # the last batch was engine 0's, on its device
    assert index.match([h(200)]) == [(0, 0), (0, 0)]  # the first one is long forgotten


def test_policy_weighs_cached_blocks_against_load():
    idle = EngineLoad()
    # Blocks held locally count in full; blocks in the store at the load cost; none at all cost the most.
    assert engine_cost(10, 10, 0, idle, 0.5) < engine_cost(10, 0, 10, idle, 0.5) < engine_cost(10, 0, 0, idle, 0.5)
    assert engine_cost(10, 0, 10, idle, 0.1) == pytest.approx(1.0 + STORE_LOAD_TRIP_BLOCKS)
    assert engine_cost(10, 0, 10, idle, 0.9) == pytest.approx(9.0 + STORE_LOAD_TRIP_BLOCKS)
    # The engine holding the prefix wins over an idle cold one, until the work queued there outweighs the saving.
    assert engine_cost(10, 8, 0, EngineLoad(num_prefilling=1, prefill_blocks=4), 0.5) < engine_cost(10, 0, 0, idle, 0.5)
    assert engine_cost(10, 8, 0, EngineLoad(num_prefilling=2, prefill_blocks=12), 0.5) > engine_cost(
        10, 0, 0, idle, 0.5
    )
    # Another client's request waiting there, or a KV cache near full, sends the request elsewhere.
    assert engine_cost(10, 8, 0, EngineLoad(others_waiting=1), 0.5) > engine_cost(10, 0, 0, idle, 0.5)
    assert engine_cost(10, 8, 0, EngineLoad(kv_cache_usage=0.99), 0.5) > engine_cost(10, 0, 0, idle, 0.5)


INFO = engine_pb2.ModelInfo(block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo="sha256")
A, B = "a:1", "b:2"
ENGINES = {A, B}


def router_of(policy: str = "prefix-aware", log=None) -> Router:
    router = Router([A, B], policy, decision_log=log)
    router.set_model_info(INFO)
    return router


def prompt_of(seed: int, num_blocks: int) -> list[int]:
    return random.Random(seed).choices(range(3, 512), k=num_blocks * BLOCK)


def finish(router: Router, *routed) -> None:
    for r in routed:
        router.first_token(r)
        router.release(r)


def test_router_spreads_cold_requests_and_follows_what_it_sent():
    """Nothing from the engines' events: the router indexes each prompt it sends under its engine at once, so the
    next turn of a conversation goes there before any BlockStored arrives."""
    router = router_of()
    first, second = prompt_of(1, 4), prompt_of(2, 4)
    routed = [router.route(ENGINES, first), router.route(ENGINES, second)]
    assert {r.address for r in routed} == ENGINES  # cold: the second is not queued behind the first's prefill
    finish(router, *routed)
    assert all(load == EngineLoad() for load in router.loads.values())
    for turn in range(2):  # whatever the turn, each conversation's next turn goes where its last one went
        router.turn = turn
        later = [router.route(ENGINES, first + [7] * 20), router.route(ENGINES, second + [7] * 20)]
        assert [r.address for r in later] == [r.address for r in routed]
        finish(router, *later)
    # A salt makes other blocks: no engine holds them, and the turn decides.
    router.turn = router.engines.index(routed[1].address)
    assert router.route(ENGINES, first, cache_salt="other tenant").address == routed[1].address
    assert Router([A, B], "round-robin").route(ENGINES, first).address == A
    with pytest.raises(ValueError, match="routing must be one of prefix-aware, least-loaded, round-robin"):
        Router([A], "nearest")


def test_a_new_conversation_is_not_piled_onto_an_engine_busy_prefilling():
    """Two conversations' first turns (cold, long) arrive together: they go to different engines, whichever engine
    the turn starts from."""
    for start in range(2):
        router = router_of()
        router.turn = start
        one = router.route(ENGINES, prompt_of(1, 48))
        two = router.route(ENGINES, prompt_of(2, 48))
        assert one.address != two.address


def test_a_turn_leaves_its_holder_busy_with_another_prefill_when_the_store_has_it():
    """The engine holding a conversation's history is prefilling another conversation's long first turn; the other
    engine is idle and the kvstore holds the history: the turn goes to the idle engine, which loads it. Without the
    store the two cost the same (the holder's queue, or the whole history computed again), and the holder keeps it."""
    history = prompt_of(1, 48)
    turn = history + [7] * 2 * BLOCK
    for in_store in (True, False):
        router = router_of()
        hashes = router.block_hashes(history, None)
        router.index.apply(0, batch(1, stored(hashes)))
        if in_store:
            router.index.apply(0, batch(2, stored(hashes, medium="kvstore")))
        router.turn = 0  # the new conversation's cold prompt goes to A by its turn
        busy = router.route(ENGINES, prompt_of(2, 48))
        assert busy.address == A and router.loads[A].prefill_blocks == 48
        assert router.route(ENGINES, turn).address == (B if in_store else A)


def test_a_turn_stays_with_its_holder_for_a_small_prefill_queued_there():
    """The holder of a conversation's history has another conversation's short turn queued, the other engine decodes
    one request, and the store holds the history at a cheap measured load cost: the turn stays (the queued turn runs
    in the same step; a load waits for its round trip). Behind a long prefill there, it goes to the other engine."""
    history = prompt_of(1, 50)
    turn = history + [7] * 3 * BLOCK
    for queued, expected in ((3, A), (50, B)):
        router = router_of()
        hashes = router.block_hashes(history, None)
        router.index.apply(0, batch(1, stored(hashes)))
        router.index.apply(0, batch(2, stored(hashes, medium="kvstore")))
        for address in ENGINES:
            router.update_load(address, engine_pb2.Load(kv_load_cost=0.04))
        router.loads[A] = EngineLoad(num_prefilling=1, prefill_blocks=queued, kv_load_cost=0.04)
        router.loads[B].num_decoding = 1
        for start in range(2):
            router.turn = start
            routed = router.route(ENGINES, turn)
            assert routed.address == expected, queued
            router.release(routed)


def test_the_engine_holding_the_prefix_wins_at_equal_load():
    """Equal loads: the prompt goes where its prefix is, however cheap the store makes loading it elsewhere."""
    prompt = prompt_of(3, 10)
    for load_cost in (None, 0.5, 0.01):
        router = router_of()
        hashes = router.block_hashes(prompt, None)
        router.index.apply(1, batch(1, stored(hashes[:8])))
        router.index.apply(1, batch(2, stored(hashes[:8], medium="kvstore")))
        for address in ENGINES:
            router.update_load(address, engine_pb2.Load(kv_load_cost=load_cost) if load_cost else engine_pb2.Load())
        for turn in range(2):
            router.turn = turn
            routed = router.route(ENGINES, prompt)
            assert routed.address == B, load_cost
            router.release(routed)


def test_blocks_in_the_store_do_not_bias_the_choice():
    """The store holds the prompt and neither engine does: each engine gets it in turn at equal load, even when
    one engine has measured a cheap load cost and the other has not measured it yet; with one engine busier, the
    other gets it."""
    prompt = prompt_of(4, 10)
    router = router_of()
    hashes = router.block_hashes(prompt, None)
    router.index.apply(0, batch(1, stored(hashes, medium="kvstore")))
    router.update_load(A, engine_pb2.Load(kv_load_cost=0.05))
    router.update_load(B, engine_pb2.Load())
    chosen = []
    for turn in range(2):
        router.turn = turn
        routed = router.route(ENGINES, prompt)
        chosen.append(routed.address)
        router.release(routed)
        router.index = KVBlockIndex(2)  # forget what was sent: only the store holds the prompt again
        router.index.apply(0, batch(1, stored(hashes, medium="kvstore")))
    assert sorted(chosen) == sorted(ENGINES)
    router.loads[A].num_decoding = 1
    for turn in range(2):
        router.turn = turn
        assert router.route(ENGINES, prompt).address == B
        router.index = KVBlockIndex(2)
        router.index.apply(0, batch(1, stored(hashes, medium="kvstore")))
        router.loads[B] = EngineLoad()


def test_polled_queue_lengths_do_not_count_the_gateways_own_requests_again():
    """GetLoad's waiting and running requests include those this gateway sent, already counted from what it sent:
    only those beyond them weigh again. So a request of ours waiting at the engine holding the prefix (as one does
    while the engine looks its blocks up in the store) does not send the next prompt away."""
    router = router_of()
    prompt = prompt_of(5, 10)
    router.index.apply(0, batch(1, stored(router.block_hashes(prompt, None))))
    router.turn = 0
    ours = router.route(ENGINES, prompt_of(6, 1))
    assert ours.address == A  # cold and small: the engine in turn
    router.update_load(A, engine_pb2.Load(num_waiting=1, num_running=0))  # ours, waiting on its lookup
    router.update_load(B, engine_pb2.Load(num_waiting=0, num_running=0))
    assert (router.loads[A].others_waiting, router.loads[A].others_running) == (0, 0)
    assert router.route(ENGINES, prompt).address == A
    # One more waiting at A than the gateway sent there: another client's, weighed as a prompt like this one.
    router.update_load(A, engine_pb2.Load(num_waiting=3, num_running=0))
    assert (router.loads[A].others_waiting, router.loads[A].others_running) == (1, 0)
    assert router.route(ENGINES, prompt).address == B
    # Running ones beyond the gateway's weigh as decoding requests.
    router.update_load(B, engine_pb2.Load(num_waiting=1, num_running=3))
    assert (router.loads[B].others_waiting, router.loads[B].others_running) == (0, 3)


def test_the_decision_log_has_each_choice_and_what_it_weighed():
    log = io.StringIO()
    router = router_of(log=log)
    prompt = prompt_of(7, 6)
    router.index.apply(1, batch(1, stored(router.block_hashes(prompt, None)[:4])))
    router.apply_events(B, engine_pb2.KvEventBatch(sequence_number=2, timestamp=time.time() - 0.25))
    router.update_load(A, engine_pb2.Load(num_waiting=1, num_running=1, kv_load_cost=0.2))
    routed = router.route(ENGINES, prompt)
    least_loaded = router_of("least-loaded", log=log)
    least_loaded.route(ENGINES, prompt)
    first, second = [json.loads(line) for line in log.getvalue().splitlines()]
    assert first["policy"] == "prefix-aware" and first["engine"] == routed.address == B and first["blocks"] == 6
    assert first["kv_load_cost"] == pytest.approx(0.2)
    a, b = first["engines"][A], first["engines"][B]
    assert (a["local_blocks"], b["local_blocks"], b["store_blocks"]) == (0, 4, 0)
    assert (a["others_waiting"], a["others_running"]) == (1, 1)
    assert a["cost"] == pytest.approx(6 + 6 + 1) and b["cost"] == pytest.approx(2)
    assert b["event_lag_ms"] >= 250 and a["event_lag_ms"] == 0
    # The other policies log what they weighed too: what the router knows it sent (no events without prefix-aware).
    assert second["policy"] == "least-loaded" and set(second["engines"]) == ENGINES


# ---- against real engines ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, HFReference(save_random_smollm2_shaped(path, **TINY))


def test_gateway_hashes_equal_the_engines(tiny_model):
    """The router, set up from the engine's ModelInfo, names a prompt's full blocks as the engine's BlockStored
    events do: with a hash seed, another algorithm, another block size and a cache salt."""
    path, _ = tiny_model
    flags = ["--model", path, "--kv-cache-memory", "8MiB", "--enable-kv-cache-events", "--block-size", "8"]
    flags += ["--prefix-caching-hash-algo", "blake2b", "--prefix-caching-hash-seed", "deployment-7"]
    prompt = random.Random(0).choices(range(3, 512), k=45)  # 5 full blocks of 8
    with InProcessService("engine", flags) as engine, mesh_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        router = Router([engine.address])
        router.set_model_info(stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30))
        events = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(), timeout=60)
        hashes = []
        reader = threading.Thread(target=read_stored, args=(events, hashes, 5))
        reader.start()
        params = client.sampling_params(temperature=0.0, max_tokens=1)
        request = engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt, sampling_params=params, cache_salt="t1")
        list(stub.Generate(request, timeout=60))
        reader.join(60)
        events.cancel()
    assert len(hashes) == 5
    assert router.block_hashes(prompt, "t1") == hashes
    assert router.block_hashes(prompt, None) != hashes  # the salt is part of the name


def read_stored(events, hashes: list, count: int) -> None:
    for b in events:
        hashes += [x for e in b.events if e.WhichOneof("event") == "stored" for x in e.stored.block_hashes]
        if len(hashes) >= count:
            return


def test_a_new_subscriber_starts_from_the_engines_cached_blocks(tiny_model):
    """A KV event stream opened after the engine cached a prompt (as when the gateway starts, or reconnects) begins
    with a snapshot, its batches numbered 0: AllBlocksCleared, then the cached blocks. Later events follow it."""
    path, _ = tiny_model
    flags = ["--model", path, "--kv-cache-memory", "8MiB", "--enable-kv-cache-events"]
    rng = random.Random(7)
    first, second = rng.choices(range(3, 512), k=5 * BLOCK + 3), rng.choices(range(3, 512), k=2 * BLOCK + 3)
    params = client.sampling_params(temperature=0.0, max_tokens=1)
    with InProcessService("engine", flags) as engine, mesh_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        router = Router([engine.address])
        router.set_model_info(stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30))
        list(
            stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=first, sampling_params=params), timeout=60)
        )
        events = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(), timeout=60)
        snapshot = next(events)
        assert snapshot.sequence_number == 0 and [e.WhichOneof("event") for e in snapshot.events] == ["cleared"]
        snapshot = next(events)
        assert snapshot.sequence_number == 0
        assert list(snapshot.events[0].stored.block_hashes) == router.block_hashes(first, None)
        list(
            stub.Generate(engine_pb2.EngineGenerateRequest(prompt_token_ids=second, sampling_params=params), timeout=60)
        )
        later = []
        read_stored(events, later, 2)
        events.cancel()
    assert later == router.block_hashes(second, None)


@pytest.fixture(scope="module")
def mesh(tiny_model):
    path, _ = tiny_model
    args = EngineArgs(model=str(path), kv_cache_memory="16MiB", max_num_seqs=8)
    with Mesh(args, num_engines=2, service_args={"engine": ["--shutdown-timeout", "30"]}) as m:
        yield m


def conversations(seed: int, num: int = NUM_CONVERSATIONS) -> list[list[list[int]]]:
    """Per conversation, the new tokens of each turn: a system prompt shared by all with its own document first,
    then short follow-ups."""
    rng = random.Random(seed)
    system = rng.choices(range(3, 512), k=SYSTEM_TOKENS)
    return [
        [system + rng.choices(range(3, 512), k=DOCUMENT_TOKENS)]
        + [rng.choices(range(3, 512), k=FOLLOW_UP_TOKENS) for _ in range(NUM_TURNS - 1)]
        for _ in range(num)
    ]


def ask(address: str, prompt: list[int]) -> tuple[list[int], int]:
    """One turn, greedy: the reply and the prompt tokens the engine found cached."""
    result = client.collect(
        client.generate(address, prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=120)
    )
    return list(result.token_ids[0]), result.complete.usage.cached_tokens


def run_conversations(
    address: str, seed: int, concurrent: bool = True, during=None, num: int = NUM_CONVERSATIONS
) -> list[list[tuple]]:
    """Per conversation, (prompt, reply, cached tokens) per turn, each prompt the whole history. Concurrent: each
    conversation on its own thread, turn after turn; else they take turns on one. `during(turn)` runs before each
    turn."""
    records = [[] for _ in range(num)]

    def turn(c: int, new: list[int]) -> None:
        if during is not None:
            during(len(records[c]))
        prompt = (records[c][-1][0] + records[c][-1][1] if records[c] else []) + new
        records[c].append((prompt, *ask(address, prompt)))

    convs = conversations(seed, num)
    if concurrent:
        with ThreadPoolExecutor(num) as pool:
            list(pool.map(lambda c: [turn(c, new) for new in convs[c]], range(num)))
    else:
        for t in range(NUM_TURNS):
            for c in range(num):
                turn(c, convs[c][t])
    return records


def hit_rate(records) -> float:
    turns = [turn for record in records for turn in record]
    return sum(cached for _, _, cached in turns) / sum(len(prompt) for prompt, _, _ in turns)


def assert_replies_match(records, reference: HFReference) -> None:
    for c, record in enumerate(records):
        for t, (prompt, reply, _) in enumerate(record):
            tokens, logits = reference.greedy(prompt, MAX_TOKENS)
            assert_greedy_matches(reply, tokens, logits, f"conversation {c} turn {t}")


def test_engines_split_the_cores(mesh):
    """Two engine processes on one machine each get half its cores as their OpenMP threads (unless the caller set
    OMP_NUM_THREADS); the other services get no such setting."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))

    def omp(name: str) -> str | None:
        with open(f"/proc/{mesh.services[name].popen.pid}/environ", "rb") as f:
            variables = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        value = variables.get(b"OMP_NUM_THREADS")
        return None if value is None else value.decode()

    assert omp("engine") == omp("engine-2") == threads
    assert omp("gateway") == os.environ.get("OMP_NUM_THREADS")


def test_prefix_aware_sends_each_turn_where_its_prefix_is(mesh, tiny_model):
    """Concurrent conversations through the mesh's own gateway (prefix-aware, its default with two engines). Two
    of them, one an engine: the policy weighs load against cached blocks, so with more conversations than engines
    a turn may rightly go where its prefix is not, when that engine is busy prefilling another's."""
    records = run_conversations(mesh.address, seed=1, num=2)
    for c, record in enumerate(records):
        for t in range(1, NUM_TURNS):
            previous_prompt = record[t - 1][0]
            # Only the engine that served the previous turn holds its blocks: this turn went there.
            assert record[t][2] >= len(previous_prompt) // BLOCK * BLOCK, f"conversation {c} turn {t}"
    assert_replies_match(records, tiny_model[1])


def test_prefix_aware_hit_rate_beats_least_loaded(mesh, tiny_model):
    """The conversations take turns, the same workload (new prompts) through each policy's gateway."""
    least_loaded = mesh.start_gateway(["--routing", "least-loaded"])
    try:
        baseline = run_conversations(least_loaded.address, seed=2, concurrent=False)
    finally:
        least_loaded.stop()
    records = run_conversations(mesh.address, seed=3, concurrent=False)
    assert hit_rate(records) > hit_rate(baseline) + 0.2, (hit_rate(records), hit_rate(baseline))
    assert_replies_match(records + baseline, tiny_model[1])


def test_engine_restarted_mid_run_loses_no_request(mesh, tiny_model):
    """The second engine stops (SIGTERM: it finishes what it runs) and starts again while conversations go on:
    every request completes, with the right output; those sent to it meanwhile went to the other engine."""
    restarted = threading.Event()

    def restart_once(turn: int) -> None:
        if turn == 2 and not restarted.is_set():
            restarted.set()
            mesh.services["engine-2"].stop()
            mesh.restart("engine-2")

    records = run_conversations(mesh.address, seed=4, during=restart_once)
    assert restarted.is_set() and mesh.services["engine-2"].alive()
    assert all(len(record) == NUM_TURNS for record in records)
    assert_replies_match(records, tiny_model[1])


def test_an_engine_late_to_its_health_checks_keeps_its_blocks(mesh):
    """An engine that stops answering (SIGSTOP) stays routable while fewer than HEALTH_MISSES health checks in a row
    are late, is then taken out, and keeps its blocks in the gateway's index throughout (its KV event stream never
    ended): once it answers again, the same prompt goes back to it and finds them cached."""
    tokens = random.Random(9).choices(range(3, 512), k=5 * BLOCK + 3)
    with InProcessService("gateway", mesh.backend_flags()) as gateway:
        deps = next(s for s in gateway.server.servicers if isinstance(s, Gateway)).deps
        hashes = deps.router.block_hashes(tokens, None)

        def holders() -> list[str]:
            return [a for a, (local, _) in zip(deps.router.engines, deps.router.index.match(hashes)) if local == 5]

        first, _ = ask(gateway.address, tokens)
        wait_until(lambda: len(holders()) == 1)
        [address] = holders()
        process = next(p.popen for p in mesh.services.values() if p.address == address)
        process.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: deps.health_misses[address] >= 1)
            assert address in deps.healthy_engines  # late, not yet down
            wait_until(lambda: address not in deps.healthy_engines)
            assert deps.health_misses[address] >= HEALTH_MISSES and holders() == [address]
        finally:
            process.send_signal(signal.SIGCONT)
        wait_until(lambda: address in deps.healthy_engines)
        reply, cached = ask(gateway.address, tokens)
    assert cached == 5 * BLOCK and reply == first


def test_engine_killed_mid_decode_its_request_migrates(mesh, tiny_model):
    """Two long greedy generations, one on each engine (cold prompts spread); the second engine is killed (SIGKILL)
    once both are decoding. Its request resumes on the engine left with the tokens already sent: neither client
    sees an error or a token missing, and new requests are served meanwhile by the engine left."""
    rng = random.Random(8)
    for _ in range(20):  # an engine restarted just before may not be healthy in the gateway's eyes yet: try again
        prompts = [rng.choices(range(3, 512), k=40) for _ in range(2)]
        streams = [
            client.generate(mesh.address, p, max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True, timeout=120)
            for p in prompts
        ]
        first = []
        for stream in streams:  # both past their first tokens
            chunk = next(r.chunk for r in stream if r.HasField("chunk") and any(c.token_ids for c in r.chunk.choices))
            first.append([t for c in chunk.choices for t in c.token_ids])
        if all(num_running(mesh.services[name].address) == 1 for name in ("engine", "engine-2")):
            break
        for stream in streams:
            stream.cancel()
        time.sleep(0.5)
    mesh.services["engine-2"].kill()
    try:
        for tokens, stream in zip(first, streams):
            assert len(tokens) + len(client.collect(stream).token_ids[0]) == LONG_TOKENS  # no error, none missing
        reply, _ = ask(mesh.address, prompts[0])
        assert_greedy_matches(reply, *tiny_model[1].greedy(prompts[0], MAX_TOKENS), "after the kill")
    finally:
        mesh.restart("engine-2")


def num_running(address: str) -> int:
    with mesh_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=30).num_running


def test_serve_starts_engine_replicas_that_share_one_kvstore(tiny_model):
    """`llmmesh serve --engines 2`: two engines with their KV events on, one kvstore behind both, and the gateway
    in front of them."""
    path, reference = tiny_model
    flags = ["--port", "0", "--model", path, "--engines", "2", "--kv-cache-memory", "16MiB"]
    process = Serve([*flags, "--no-sampler-service", "--log-level", "WARNING"])
    try:
        services = {}
        while len(services) < 7:
            name, address, _, _ = process.expect(SERVING_LINE).groups()
            services[name] = address
        assert set(services) == {"redis-server", "kvstore", "engine", "engine-2", "tokenizer", "detokenizer", "gateway"}
        for name in ("engine", "engine-2"):
            with mesh_channel(services[name]) as channel:
                info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
            assert info.enable_kv_cache_events, name
        prompt = random.Random(5).choices(range(3, 512), k=40)
        reply, _ = ask(process.expect(r"llmmesh gateway listening on (\S+)").group(1), prompt)
        assert_greedy_matches(reply, *reference.greedy(prompt, MAX_TOKENS), "through serve")
    finally:
        process.stop()


class StoppingEngine:
    """A gRPC server whose Generate ends CANCELLED before any message: what a real engine's server answers a call
    that reached it just as it began to stop (gRPC cancels calls not yet handled then). The window is too short
    to hit on purpose with a real engine, so this server always answers so."""

    def __enter__(self) -> str:
        def generate(request, context):
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

        handler = grpc.unary_stream_rpc_method_handler(generate, engine_pb2.EngineGenerateRequest.FromString)
        self.server = grpc.server(ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("llmmesh.v1.Engine", {"Generate": handler})]
        )
        # An engine of the mesh: the gateway reaches it over mutual TLS, as it reaches the others.
        credentials = mesh_credentials_of("engine").server_credentials()
        port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.stop(0)


@pytest.mark.parametrize("how", ["stopped", "stopping"])
def test_a_request_whose_engine_is_gone_goes_to_another(tiny_model, how):
    """The gateway still takes an engine for healthy that is gone (its health check has not run since): a request
    routed there gets UNAVAILABLE (stopped: nothing listens) or CANCELLED (stopping) before any message and goes to
    the other engine, with the right output. With only the gone one left, the request fails with UNAVAILABLE naming
    it."""
    path, reference = tiny_model
    with (
        InProcessService("engine", ["--model", path, "--kv-cache-memory", "8MiB"]) as engine,
        InProcessService("tokenizer", ["--model", path]) as tokenizer,
        InProcessService("detokenizer", ["--model", path]) as detokenizer,
        StoppingEngine() if how == "stopping" else contextlib.nullcontext(f"127.0.0.1:{free_port()}") as gone,
    ):
        prompt = random.Random(6).choices(range(3, 512), k=40)
        reply, routers, error = asyncio.run(
            generate_with_a_stale_health_view(gone, engine.address, tokenizer.address, detokenizer.address, prompt)
        )
    assert_greedy_matches(reply, *reference.greedy(prompt, MAX_TOKENS), "after the retry")
    assert routers.loads[gone] == routers.loads[engine.address] == EngineLoad()  # every request released
    assert error.code() == grpc.StatusCode.UNAVAILABLE and gone in error.details(), error.details()


async def generate_with_a_stale_health_view(gone, live, tokenizer, detokenizer, prompt):
    """A gateway in this process whose view of the engines' health is set by hand (no monitor runs): round-robin
    first tries `gone`. The reply through both engines, the router, and the error with only `gone` healthy."""
    credentials = mesh_credentials_of("gateway")
    deps = Dependencies([gone, live], tokenizer, detokenizer, routing="round-robin", credentials=credentials)
    deps.healthy_engines = {live}
    await deps.load_model_info()
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(Gateway(deps, "", RequestLimits()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    params = client.sampling_params(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=params)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            deps.healthy_engines = {gone, live}
            responses = [r async for r in stub.Generate(request, timeout=60)]
            deps.healthy_engines = {gone}
            try:
                [r async for r in stub.Generate(request, timeout=60)]
                error = None
            except grpc.aio.AioRpcError as e:
                error = e
    finally:
        await server.stop(None)
        await deps.close()
    return list(responses[-1].complete.choices[0].token_ids), deps.router, error
