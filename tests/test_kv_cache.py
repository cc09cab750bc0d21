"""Block pool, free queue, hashing and KVCacheManager."""

import hashlib
import struct

import pytest

from engine.kv.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.kv.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from engine.kv.hashing import get_hash_fn, hash_block_tokens, root_hash
from engine.kv.manager import KVCacheManager
from engine.request import Request, SamplingParams


def make_request(request_id, tokens, cache_salt=None):
    return Request(str(request_id), list(tokens), SamplingParams(max_tokens=8), cache_salt=cache_salt)


def held_blocks(pool: BlockPool) -> int:
    return sum(1 for b in pool.blocks if b.ref_cnt > 0)


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 2]
    assert queue.num_free_blocks == 4
    assert [b.block_id for b in queue.popleft_n(4)] == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        queue.popleft()


def test_hash_is_canonical_sha256_over_fixed_width_bytes():
    sha = get_hash_fn("sha256")
    parent = root_hash(sha)
    tokens = [1, 2, 300000]
    expected = hashlib.sha256(
        parent + struct.pack("<I", 3) + struct.pack("<3i", *tokens) + struct.pack("<I", 0)
    ).digest()
    assert hash_block_tokens(sha, parent, tokens) == expected
    # Chained: the same tokens under another parent hash differently.
    assert hash_block_tokens(sha, expected, tokens) != expected
    # A seed changes every hash.
    assert hash_block_tokens(sha, root_hash(sha, "other"), tokens) != expected
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        get_hash_fn("md5")


def test_33_token_cached_prompt_hits_32_tokens():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    first = make_request("a", range(33))
    blocks, hit = manager.get_computed_blocks(first)
    assert hit == 0
    assert manager.allocate_slots(first, 33) is not None
    first.num_computed_tokens = 33
    manager.free(first)

    second = make_request("b", range(33))
    blocks, hit = manager.get_computed_blocks(second)
    assert hit == 32 and len(blocks) == 1 and len(blocks[0]) == 2  # one KV cache group
    # A 32-token prompt may only hit one block: its last token must be computed.
    third = make_request("c", range(32))
    assert manager.get_computed_blocks(third)[1] == 16


def test_cache_salt_isolates_prefixes():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", range(9), cache_salt="tenant-1")
    manager.get_computed_blocks(a)
    manager.allocate_slots(a, 9)
    manager.free(a)
    assert manager.get_computed_blocks(make_request("b", range(9), cache_salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", range(9)))[1] == 0
    assert manager.get_computed_blocks(make_request("d", range(9), cache_salt="tenant-1"))[1] == 8


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    big = make_request("big", range(12))
    assert manager.allocate_slots(big, 12) is not None  # 3 blocks
    free_before = manager.get_num_free_blocks()
    other = make_request("other", range(100, 109))
    assert manager.allocate_slots(other, 9) is None  # needs 3, one free
    assert manager.get_num_free_blocks() == free_before == 1
    assert "other" not in manager.req_to_blocks
    # Prefix hits that sit in the free queue count against the free blocks too.
    manager.free(big)
    again = make_request("again", range(12))
    hits, n = manager.get_computed_blocks(again)
    assert n == 8
    holder = make_request("holder", range(200, 204))
    manager.allocate_slots(holder, 4)
    free_before = manager.get_num_free_blocks()  # 3, of which 2 are the cached hits
    assert manager.allocate_slots(again, 4 + 8, n, hits) is None  # 2 touched + 2 new > 3
    assert manager.get_num_free_blocks() == free_before
    assert all(b.ref_cnt == 0 for b in hits[0])


def test_blocks_freed_tail_first_and_evicted_lazily():
    events_on = True
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_kv_cache_events=events_on)
    req = make_request("r", range(6))
    manager.allocate_slots(req, 6)
    (ids,) = manager.get_block_ids("r")
    stored = manager.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored) and len(stored[0].block_hashes) == 3
    assert stored[0].token_ids == list(range(6))
    manager.free(req)
    order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    # Never-used blocks first, then the request's blocks tail first: the root block is evicted last.
    assert order[-3:] == ids[::-1]
    # The cached blocks stay findable until they are reused.
    assert manager.get_computed_blocks(make_request("x", range(7)))[1] == 6
    hog = make_request("hog", range(100, 112))
    manager.allocate_slots(hog, 12)  # takes all 6 blocks: 3 free + the 3 cached ones, tail first
    removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removed] == stored[0].block_hashes[::-1]
    manager.free(hog)
    assert manager.get_computed_blocks(make_request("y", range(7)))[1] == 0


def test_touch_takes_cached_block_out_of_free_queue():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 3
    pool.touch([blocks[0]])  # a second sharer only adds a reference
    assert blocks[0].ref_cnt == 2 and pool.get_num_free_blocks() == 3


def test_reset_prefix_cache_only_when_nothing_is_held():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_kv_cache_events=True)
    req = make_request("r", range(4))
    manager.allocate_slots(req, 4)
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    manager.take_events()
    assert manager.reset_prefix_cache() is True
    assert isinstance(manager.take_events()[0], AllBlocksCleared)
    assert manager.get_computed_blocks(make_request("s", range(5)))[1] == 0


def test_prefix_caching_off_never_hits():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    req = make_request("r", range(5))
    manager.allocate_slots(req, 5)
    manager.free(req)
    assert manager.get_computed_blocks(make_request("s", range(5))) == ([[]], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_shared_prefix_blocks_are_reference_counted():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(10))
    manager.allocate_slots(a, 10)
    b = make_request("b", list(range(8)) + [50, 51])
    hits, n = manager.get_computed_blocks(b)
    assert n == 8
    manager.allocate_slots(b, 2, n, hits)
    assert manager.get_block_ids("a")[0][:2] == manager.get_block_ids("b")[0][:2]
    assert [blk.ref_cnt for blk in hits[0]] == [2, 2]
    manager.free(a)
    assert [blk.ref_cnt for blk in hits[0]] == [1, 1]
    manager.free(b)
    assert held_blocks(manager.block_pool) == 0
    assert manager.get_num_free_blocks() == 8
