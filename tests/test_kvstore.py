"""The kvstore service (llmmesh.v1.KVStore) on real redis-server processes: blocks in and out byte for byte, as
bytes and through an engine's shared memory, the header and checksum that keep a wrong or damaged block out, bad
input, Redis dying and coming back, and eviction under maxmemory."""

import contextlib
import hashlib
import os
import random
import signal
import time

import grpc
import pytest
import redis

from conftest import NOT_SERVING, SERVING, InProcessService, mesh_channel, undecodable, wait_for_health
from llmmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from mesh.kvstore.client import Staging
from mesh.shared_memory import SHM_DIR
from services import kvstore_service
from services.kvstore_layout import block_key
from services.kvstore_service import GET_CHUNK_BYTES, SERVICE_NAME
from services.local_mesh import kv_transfer_config
from services.redis_server import RedisServer
from services.server import CHANNEL_OPTIONS
from services.service_process import ServiceProcess

FP = hashlib.sha256(b"smollm2 float32 block 16").hexdigest()
OTHER_FP = hashlib.sha256(b"smollm2 bfloat16 block 16").hexdigest()
SHAPE = (2, 2, 3, 16, 8)  # layers, K/V, KV heads, block size, head dim
BLOCK_BYTES = 2 * 2 * 3 * 16 * 8 * 4
CALL_TIMEOUT = 20.0  # s: a call that hangs fails the test with DEADLINE_EXCEEDED instead of hanging it


def layout(fingerprint=FP, dtype="float32", shape=SHAPE, num_layers=2, block_size=16):
    return kvstore_pb2.BlockLayout(
        fingerprint=fingerprint, dtype=dtype, shape=shape, num_layers=num_layers, block_size=block_size
    )


def chain(n: int, seed: int = 0) -> list[bytes]:
    """n chained 32-byte block hashes, as the engine's prefix cache makes them."""
    hashes, parent = [], seed.to_bytes(8, "little")
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        hashes.append(parent)
    return hashes


def blocks_for(hashes: list[bytes], nbytes: int = BLOCK_BYTES, seed: int = 0) -> dict[bytes, bytes]:
    rng = random.Random(seed)
    return {h: rng.randbytes(nbytes) for h in hashes}


class Store:
    """A blocking client of the kvstore at address."""

    def __init__(self, address: str):
        self.address = address
        self.channel = mesh_channel(address, options=CHANNEL_OPTIONS)
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel)

    def put(self, blocks: dict[bytes, bytes], block_layout=None, per_message: int = 64) -> kvstore_pb2.PutResponse:
        items = [kvstore_pb2.KVBlock(block_hash=h, data=d) for h, d in blocks.items()]
        messages = [
            kvstore_pb2.PutRequest(blocks=items[i : i + per_message]) for i in range(0, len(items), per_message)
        ]
        messages = messages or [kvstore_pb2.PutRequest()]
        messages[0].layout.CopyFrom(block_layout or layout())
        return self.stub.Put(iter(messages), timeout=CALL_TIMEOUT)

    def get_responses(self, hashes, block_layout=None, shared_memory="") -> list[kvstore_pb2.GetResponse]:
        request = kvstore_pb2.GetRequest(
            layout=block_layout or layout(), block_hashes=hashes, shared_memory=shared_memory
        )
        return list(self.stub.Get(request, timeout=CALL_TIMEOUT))

    def get(self, hashes, block_layout=None, nbytes: int = BLOCK_BYTES, staging=None) -> list[tuple[bytes, bytes]]:
        """(hash, bytes) of the blocks answered, the stream's bytes cut into blocks of nbytes in the order asked;
        with staging, the blocks the kvstore says it wrote there (and no response may carry bytes)."""
        responses = self.get_responses(hashes, block_layout, staging.name if staging else "")
        if staging is None:
            data = b"".join(r.data for r in responses)
        else:
            assert all(r.num_blocks and not r.data for r in responses)
            data = bytes(staging.view[: sum(r.num_blocks for r in responses) * nbytes])
        assert len(data) % nbytes == 0
        return list(zip(hashes, (data[i : i + nbytes] for i in range(0, len(data), nbytes)), strict=False))

    def lookup(self, hashes, fingerprint=FP) -> int:
        request = kvstore_pb2.LookupRequest(fingerprint=fingerprint, block_hashes=hashes)
        return self.stub.Lookup(request, timeout=CALL_TIMEOUT).num_present

    def delete(self, hashes, fingerprint=FP) -> int:
        request = kvstore_pb2.DeleteRequest(fingerprint=fingerprint, block_hashes=hashes)
        return self.stub.Delete(request, timeout=CALL_TIMEOUT).num_deleted

    def stats(self) -> kvstore_pb2.StatsResponse:
        return self.stub.Stats(kvstore_pb2.StatsRequest(), timeout=CALL_TIMEOUT)

    def close(self) -> None:
        self.channel.close()


@contextlib.contextmanager
def running_store(redis_server: RedisServer, *flags):
    """`llmmesh kvstore <flags>` in this process on redis_server; a client of it."""
    with InProcessService("kvstore", ["--redis-url", redis_server.url, *flags], timeout=60) as service:
        client = Store(service.address)
        try:
            yield client
        finally:
            client.close()


@pytest.fixture
def store(redis_server):
    with running_store(redis_server, "--max-blocks-per-request", 256) as client:
        yield client


@pytest.fixture
def raw_redis(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_put_lookup_get_delete_stats(store):
    hashes = chain(8)
    blocks = blocks_for(hashes)
    put = store.put(blocks, per_message=3)
    assert (put.num_stored, put.num_skipped) == (8, 0)
    assert store.lookup(hashes) == 8
    assert store.get(hashes) == list(blocks.items())  # the same bytes, in the order asked
    stats = store.stats()
    assert stats.keys == 8 and stats.blocks_stored == 8
    assert stats.bytes_in == stats.bytes_out == 8 * BLOCK_BYTES
    assert stats.bytes > 8 * BLOCK_BYTES  # Redis's used_memory holds them
    assert (stats.hits, stats.misses, stats.corrupt_blocks, stats.redis_errors) == (16, 0, 0, 0)

    assert store.delete(hashes[5:] + chain(2, seed=9)) == 3  # hashes never stored are no error
    assert store.lookup(hashes) == 5
    assert store.get(hashes) == list(blocks.items())[:5]
    stats = store.stats()
    assert stats.keys == 5 and (stats.hits, stats.misses) == (26, 6)
    assert store.lookup([]) == 0 and store.get([]) == [] and store.delete([]) == 0


@pytest.fixture(params=["bytes", "shared memory"])
def staging(request):
    """None (Get carries the blocks), or a segment of 64 blocks as an engine's connector makes it."""
    if request.param == "bytes":
        yield None
        return
    segment = Staging(64, BLOCK_BYTES)
    yield segment
    segment.close()


def test_get_keeps_the_order_asked_and_stops_at_the_first_missing_block(store, staging):
    hashes = chain(6)
    blocks = blocks_for(hashes)
    store.put({h: blocks[h] for i, h in enumerate(hashes) if i != 3})
    assert store.lookup(hashes) == 3
    assert store.get(hashes, staging=staging) == [(h, blocks[h]) for h in hashes[:3]]
    assert store.lookup(hashes[3:]) == 0 and store.get(hashes[3:], staging=staging) == []
    shuffled = [hashes[4], hashes[0], hashes[2], hashes[3], hashes[1]]
    assert store.get(shuffled, staging=staging) == [(h, blocks[h]) for h in shuffled[:3]]
    assert store.lookup(shuffled) == 3


def test_get_streams_chunks_of_at_most_get_chunk_bytes():
    """12 blocks of 1 MiB: no response over GET_CHUNK_BYTES (4 MiB), so several, the bytes intact and in order."""
    big = layout(shape=(512, 512), num_layers=1)
    hashes = chain(12)
    blocks = blocks_for(hashes, nbytes=2**20)
    with RedisServer(maxmemory="256mb") as redis_server, running_store(redis_server) as store:
        assert store.put(blocks, big).num_stored == 12
        responses = store.get_responses(hashes, big)
        assert len(responses) >= 12 * 2**20 // GET_CHUNK_BYTES
        assert all(0 < len(r.data) <= GET_CHUNK_BYTES and len(r.data) % 2**20 == 0 for r in responses)
        assert b"".join(r.data for r in responses) == b"".join(blocks.values())
        assert store.get(hashes[:5] + chain(1, seed=3) + hashes[5:], big, 2**20) == list(blocks.items())[:5]


def test_put_skips_blocks_already_present(store):
    hashes = chain(5)
    blocks = blocks_for(hashes)
    assert store.put({h: blocks[h] for h in hashes[:3]}).num_stored == 3
    put = store.put(blocks, per_message=2)
    assert (put.num_stored, put.num_skipped) == (2, 3)
    again = store.put(blocks)
    assert (again.num_stored, again.num_skipped) == (0, 5)
    # The same block twice in one message is stored once.
    twice = kvstore_pb2.KVBlock(block_hash=chain(1, seed=7)[0], data=bytes(BLOCK_BYTES))
    put = store.stub.Put(iter([kvstore_pb2.PutRequest(layout=layout(), blocks=[twice, twice])]), timeout=CALL_TIMEOUT)
    assert (put.num_stored, put.num_skipped) == (1, 1)
    # A later message may repeat the first one's layout.
    later = kvstore_pb2.PutRequest(
        layout=layout(), blocks=[kvstore_pb2.KVBlock(block_hash=chain(1, seed=8)[0], data=bytes(BLOCK_BYTES))]
    )
    put = store.stub.Put(iter([kvstore_pb2.PutRequest(layout=layout()), later]), timeout=CALL_TIMEOUT)
    assert put.num_stored == 1
    stats = store.stats()
    assert stats.blocks_stored == 7 and stats.bytes_in == 16 * BLOCK_BYTES  # every block received counts in


def test_fingerprints_keep_blocks_apart_and_a_wrong_layout_is_never_loaded(store, raw_redis):
    hashes = chain(3)
    blocks = blocks_for(hashes)
    store.put(blocks)
    assert store.lookup(hashes, OTHER_FP) == 0
    assert store.get(hashes, layout(fingerprint=OTHER_FP)) == []
    assert store.put(blocks, layout(fingerprint=OTHER_FP, dtype="bfloat16", shape=(2, 2, 3, 16, 16))).num_stored == 3
    assert store.get(hashes) == list(blocks.items())  # still this fingerprint's own bytes

    # Asked for under the same fingerprint with another layout of the same size: the header does not match,
    # so the block is dropped and counted, and the stream stops there.
    same_size = layout(dtype="float16", shape=(2, 2, 3, 16, 16))
    assert store.get(hashes[1:], same_size) == []
    assert store.stats().corrupt_blocks == 1
    assert not raw_redis.exists(block_key(FP, hashes[1]))
    assert store.get(hashes) == [(hashes[0], blocks[hashes[0]])]
    assert store.get(hashes, layout(block_size=8)) == []  # num_layers and block_size are in the header too
    assert store.stats().corrupt_blocks == 2


@pytest.mark.parametrize("where", ["data", "checksum", "header", "length", "type"])
def test_a_damaged_value_is_dropped_counted_and_treated_as_missing(store, raw_redis, staging, where):
    hashes = chain(4)
    blocks = blocks_for(hashes)
    store.put(blocks)
    key = block_key(FP, hashes[2])
    value = bytearray(raw_redis.get(key))
    if where == "type":  # a list under the key: MGET answers nothing for it
        raw_redis.delete(key)
        raw_redis.rpush(key, bytes(value))
    elif where == "length":
        raw_redis.set(key, bytes(value[:-1]))
    else:
        value[{"data": len(value) - 1, "checksum": len(value) - BLOCK_BYTES - 1, "header": 5}[where]] ^= 0x01
        raw_redis.set(key, bytes(value))

    assert store.get(hashes, staging=staging) == [(h, blocks[h]) for h in hashes[:2]]
    if where == "type":  # missing, as far as Get can tell: left for Put's SET to replace
        assert store.stats().corrupt_blocks == 0
        raw_redis.delete(key)
    else:
        stats = store.stats()
        assert stats.corrupt_blocks == 1 and stats.keys == 3
    assert not raw_redis.exists(key)
    assert store.lookup(hashes) == 2
    assert store.put(blocks).num_stored == 1  # put again, it loads again
    assert store.get(hashes, staging=staging) == list(blocks.items())


def test_shared_memory_the_kvstore_cannot_map_gets_the_blocks_as_bytes(store):
    """A segment that is not this user's private one, or whose name is gone, is declined: the Get carries the
    blocks, as for a kvstore on another host."""
    hashes = chain(3)
    blocks = blocks_for(hashes)
    store.put(blocks)
    segment = Staging(4, BLOCK_BYTES)
    try:
        os.chmod(os.path.join(SHM_DIR, segment.name), 0o640)
        for name in (segment.name, "llmmesh-kv-" + "0" * 32):
            responses = store.get_responses(hashes, shared_memory=name)
            assert all(r.data and not r.num_blocks for r in responses)
            assert b"".join(r.data for r in responses) == b"".join(blocks.values())
        assert not any(segment.view)  # nothing was written there
    finally:
        segment.close()


def test_a_segment_the_kvstore_mapped_serves_after_its_name_is_gone(store):
    """The engine unlinks its segment's name after the first Get: the kvstore keeps its mapping."""
    hashes = chain(5)
    blocks = blocks_for(hashes)
    store.put(blocks)
    segment = Staging(8, BLOCK_BYTES)
    try:
        assert store.get(hashes[:2], staging=segment) == [(h, blocks[h]) for h in hashes[:2]]
        segment.unlink()
        assert not os.path.exists(os.path.join(SHM_DIR, segment.name))
        assert store.get(hashes, staging=segment) == list(blocks.items())
    finally:
        segment.close()


def test_a_segment_left_idle_is_let_go_and_its_engine_gets_bytes(store, monkeypatch):
    """A mapping that no Get used for SEGMENT_IDLE_S is dropped at the next Get (its engine may be gone, and the
    memory with it): a later Get into it, its name gone, is answered with bytes."""
    monkeypatch.setattr(kvstore_service, "SEGMENT_IDLE_S", 0.2)
    hashes = chain(2)
    blocks = blocks_for(hashes)
    store.put(blocks)
    idle, busy = Staging(4, BLOCK_BYTES), Staging(4, BLOCK_BYTES)
    try:
        assert store.get(hashes, staging=idle) == list(blocks.items())
        idle.unlink()
        time.sleep(0.3)
        assert store.get(hashes, staging=busy) == list(blocks.items())  # lets the idle one go
        responses = store.get_responses(hashes, shared_memory=idle.name)
        assert all(r.data and not r.num_blocks for r in responses)
        assert store.get(hashes, staging=busy) == list(blocks.items())  # the one in use stays
    finally:
        idle.close()
        busy.close()


@pytest.mark.parametrize("credentials", [":secret", "kv:other-secret"])
def test_a_redis_with_a_password_and_a_database(redis_server, raw_redis, staging, credentials):
    """The URL's password (or ACL user) and database reach every read, those of Get's own connections too; once the
    password changes, a Get is UNAVAILABLE naming Redis, and the service stays up."""
    raw_redis.acl_setuser("kv", enabled=True, passwords=["+other-secret"], keys=["*"], commands=["+@all"])
    raw_redis.config_set("requirepass", "secret")  # raw_redis's connection stays signed in
    url = redis_server.url.replace("redis://", f"redis://{credentials}@").replace("/0", "/3")
    hashes = chain(3)
    blocks = blocks_for(hashes)
    with running_store(redis_server, "--redis-url", url) as store:
        assert store.put(blocks).num_stored == 3 and store.lookup(hashes) == 3
        assert store.get(hashes, staging=staging) == list(blocks.items())
        in_three = redis.Redis.from_url(url)
        assert in_three.dbsize() == 3 and raw_redis.dbsize() == 0  # the blocks are in database 3
        in_three.close()
        raw_redis.config_set("requirepass", "rotated")
        raw_redis.acl_setuser("kv", enabled=True, reset_passwords=True, passwords=["+rotated"])
        with pytest.raises(grpc.RpcError) as caught:
            store.get(hashes, staging=staging)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "redis at" in caught.value.details()
        assert store.stub.Stats(kvstore_pb2.StatsRequest(), timeout=CALL_TIMEOUT).redis_errors == 1


def put_message(block_layout=layout(), sizes=(BLOCK_BYTES, BLOCK_BYTES), hash_bytes=32) -> kvstore_pb2.PutRequest:  # noqa: B008 (an immutable default)
    blocks = [kvstore_pb2.KVBlock(block_hash=h[:hash_bytes], data=bytes(n)) for h, n in zip(chain(len(sizes)), sizes)]
    return kvstore_pb2.PutRequest(layout=block_layout, blocks=blocks)


HUGE = (2**32 - 1,) * 8
# (rpc, request or stream of requests, what the message must name)
BAD_INPUT = [
    ("Lookup", kvstore_pb2.LookupRequest(fingerprint="abc", block_hashes=chain(1)), "fingerprint must be 64 lowercase"),
    ("Lookup", kvstore_pb2.LookupRequest(fingerprint=FP.upper(), block_hashes=chain(1)), "fingerprint"),
    ("Lookup", kvstore_pb2.LookupRequest(fingerprint=FP, block_hashes=[*chain(1), b"x" * 31]), "block_hashes[1] must"),
    ("Lookup", kvstore_pb2.LookupRequest(fingerprint=FP, block_hashes=chain(257)), "--max-blocks-per-request"),
    ("Delete", kvstore_pb2.DeleteRequest(fingerprint=FP, block_hashes=[b""]), "block_hashes[0] must be 32 bytes"),
    ("Delete", kvstore_pb2.DeleteRequest(fingerprint="", block_hashes=chain(1)), "fingerprint"),
    ("Get", kvstore_pb2.GetRequest(block_hashes=chain(1)), "layout must be set"),
    ("Get", kvstore_pb2.GetRequest(layout=layout(fingerprint="g" * 64), block_hashes=chain(1)), "layout.fingerprint"),
    ("Get", kvstore_pb2.GetRequest(layout=layout(), block_hashes=chain(300)), "block_hashes holds 300"),
    ("Get", kvstore_pb2.GetRequest(layout=layout(), block_hashes=chain(1), shared_memory="../x"), "shared_memory must"),
    ("Put", [put_message(None)], "layout must be set"),
    ("Put", [put_message(layout(dtype="int8"))], "layout.dtype must be one of float32, float16, bfloat16"),
    ("Put", [put_message(layout(shape=()))], "layout.shape must have 1 to 8 dimensions"),
    ("Put", [put_message(layout(shape=(2, 2, 0, 16, 8)))], "layout.shape[2] must be at least 1"),
    ("Put", [put_message(layout(shape=HUGE))], "--max-block-bytes"),
    ("Put", [put_message(layout(num_layers=0))], "layout.num_layers"),
    ("Put", [put_message(layout(block_size=0))], "layout.block_size"),
    ("Put", [put_message(sizes=(BLOCK_BYTES, BLOCK_BYTES - 1))], f"blocks[1].data must be {BLOCK_BYTES} bytes"),
    ("Put", [put_message(sizes=(BLOCK_BYTES + 8,))], f"got {BLOCK_BYTES + 8}"),
    ("Put", [put_message(hash_bytes=5)], "blocks[0].block_hash must be 32 bytes"),
    ("Put", [put_message(), put_message(layout(block_size=8))], "a later message's layout must equal"),
]


def test_bad_input_is_invalid_argument_naming_the_field_and_the_service_stays_up(store):
    hashes = chain(2)
    store.put(blocks_for(hashes))
    small = Staging(1, BLOCK_BYTES)  # a segment with room for fewer blocks than asked
    too_many = kvstore_pb2.GetRequest(layout=layout(), block_hashes=hashes, shared_memory=small.name)
    for rpc, request, named in [*BAD_INPUT, ("Get", too_many, "shared_memory: the segment holds")]:
        call = getattr(store.stub, rpc)
        with pytest.raises(grpc.RpcError) as caught:
            if rpc == "Put":
                call(iter(request), timeout=CALL_TIMEOUT)
            elif rpc == "Get":
                list(call(request, timeout=CALL_TIMEOUT))
            else:
                call(request, timeout=CALL_TIMEOUT)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, named, caught.value.details())
        assert named in caught.value.details(), (rpc, named, caught.value.details())
        assert store.lookup(hashes) == 2, (rpc, named)
    garbage = store.channel.unary_unary(f"/{SERVICE_NAME}/Lookup")
    with pytest.raises(grpc.RpcError) as caught:
        garbage(undecodable(kvstore_pb2.LookupRequest), timeout=CALL_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    small.close()
    stats = store.stats()
    assert stats.keys == 2 and stats.blocks_stored == 2 and stats.redis_errors == 0


def test_redis_killed_then_back_on_its_port(redis_server):
    with running_store(redis_server, "--redis-timeout", "1") as store:
        hashes = chain(3)
        blocks = blocks_for(hashes)
        store.put(blocks)
        redis_server.kill()
        wait_for_health(store.address, NOT_SERVING, service=SERVICE_NAME)
        calls = [
            lambda: store.lookup(hashes),
            lambda: store.get(hashes),
            lambda: store.put(blocks),
            lambda: store.delete(hashes),
            store.stats,
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            assert f"redis at 127.0.0.1:{redis_server.port}/0 is unreachable" in caught.value.details()

        redis_server.start()  # the same port, empty, as a restarted cache comes back
        wait_for_health(store.address, SERVING)
        assert store.lookup(hashes) == 0
        assert store.put(blocks).num_stored == 3
        assert store.get(hashes) == list(blocks.items())
        assert store.stats().redis_errors == len(calls)


def test_a_stuck_redis_is_unavailable_not_a_hang(redis_server):
    """Redis stopped (SIGSTOP: connections open, no answer): calls fail with UNAVAILABLE after --redis-timeout,
    health says NOT_SERVING, and all is well again once it goes on."""
    with running_store(redis_server, "--redis-timeout", "0.5") as store:
        hashes = chain(2)
        blocks = blocks_for(hashes)
        store.put(blocks)
        redis_server.popen.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as caught:
                store.get(hashes)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            wait_for_health(store.address, NOT_SERVING)
        finally:
            redis_server.popen.send_signal(signal.SIGCONT)
        wait_for_health(store.address, SERVING)
        assert store.get(hashes) == list(blocks.items())


def test_eviction_under_maxmemory_costs_blocks_never_errors():
    """A 4 MB Redis and 200 blocks of 64 KiB in 20 chains: the oldest are evicted, every call succeeds, and what
    Get returns is a prefix of what Lookup promised, byte for byte."""
    block = layout(shape=(16384,), num_layers=1, block_size=16)
    chains = [chain(10, seed=s) for s in range(20)]
    data = {s: blocks_for(hashes, 65536, seed=s) for s, hashes in enumerate(chains)}
    with RedisServer(maxmemory="4mb") as redis_server, running_store(redis_server) as store:
        for s in range(20):
            assert store.put(data[s], block).num_stored == 10
        present = [store.lookup(hashes) for hashes in chains]
        # Redis's LRU is approximate (it evicts the oldest of a few sampled keys), so which blocks stay is not
        # exact: the first chain lost blocks and some block stays to be read back.
        assert present[0] < 10 and 0 < sum(present) < 200
        # Redis goes on evicting while it is over maxmemory, on reads too: a Get may return less than its Lookup
        # promised, never other bytes.
        got = [store.get(hashes, block, 65536) for hashes in chains]
        for s, blocks in enumerate(got):
            assert len(blocks) <= present[s] and blocks == list(data[s].items())[: len(blocks)]
        assert any(got)
        stats = store.stats()
        assert stats.blocks_stored == 200 and stats.bytes_in == 200 * 65536
        assert 0 < stats.keys < 200
        assert stats.bytes < 8 * 2**20  # near maxmemory, never the 12.5 MiB put
        assert stats.redis_errors == 0 and stats.corrupt_blocks == 0


def test_the_kvstore_command_serves_and_drains_on_sigterm(redis_server):
    process = ServiceProcess("kvstore", ["--port", "0", "--redis-url", redis_server.url])
    try:
        address = process.wait_listening(120)
        wait_for_health(address, SERVING, service=SERVICE_NAME)
        store = Store(address)
        assert store.put(blocks_for(chain(2))).num_stored == 2
        assert store.lookup(chain(2)) == 2
        store.close()
        process.popen.send_signal(signal.SIGTERM)
        assert process.popen.wait(60) == 0
    finally:
        process.kill()


def test_the_engine_is_pointed_at_the_kvstore_as_vllm_configures_a_connector():
    import json

    config = json.loads(kv_transfer_config("127.0.0.1:4242"))
    assert config == {
        "kv_connector": "KVStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvstore_address": "127.0.0.1:4242"},
    }
