"""KV blocks against parties that reach the store: a block forged in Redis, where the kvstore keeps it, with a
header and checksum the kvstore accepts, is never loaded. The engine recomputes, and its output is unchanged."""

import pytest
import redis
from crc32c import crc32c
from test_kv_connector import (  # noqa: F401 (kvstore, prompts and references are fixtures)
    MAX_TOKENS,
    assert_all_match,
    connector_stats,
    engine_request_hashes,
    kvstore,
    make_engine,
    prompts,
    references,
    settle,
)

from conftest import assert_no_leaks, run_greedy
from mesh.kvstore.block_tag import TAG_BYTES

pytestmark = pytest.mark.slow


def forge(value: bytes, block_bytes: int, tag: bytes | None = None) -> bytes:
    """The stored value with its data changed and its checksum made good again: what anyone who can write to
    Redis can do. The tag stays the one an engine made for the old data, or becomes `tag`."""
    prefix, data = value[:-block_bytes], bytearray(value[-block_bytes:])
    header, old_tag = prefix[: -TAG_BYTES - 4], prefix[-TAG_BYTES - 4 : -4]
    data[100] ^= 0xFF
    tag = old_tag if tag is None else tag
    return header + tag + crc32c(bytes(data), crc32c(tag)).to_bytes(4, "little") + bytes(data)


@pytest.mark.parametrize("tag", ["kept", "zeros"])
def test_a_block_forged_in_redis_is_not_loaded(redis_server, kvstore, prompts, references, tag):
    client = redis.Redis.from_url(redis_server.url)
    engine = make_engine(kvstore.address)
    run_greedy(engine, prompts[:1], MAX_TOKENS)
    settle(engine)
    engine.reset_prefix_cache()
    block_hash = engine_request_hashes(engine, prompts[0])[2]
    (key,) = client.keys(f"kv:*:{block_hash.hex()}")
    value = client.get(key)
    block_bytes = connector_stats(engine)["stored_bytes"] // connector_stats(engine)["stored_blocks"]
    client.set(key, forge(value, block_bytes, None if tag == "kept" else bytes(TAG_BYTES)))

    assert_all_match(run_greedy(engine, prompts[:1], MAX_TOKENS), references[:1], "after forgery")
    stats = connector_stats(engine)
    assert stats["loaded_tokens"] == 2 * 16  # the two blocks before the forged one
    assert stats["load_failed_tokens"] > 0  # the rest was recomputed
    settle(engine)
    assert_no_leaks(engine)
    engine.shutdown()
