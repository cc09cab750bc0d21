"""BlockTagger on its own: a block loads only with the tag an engine holding the key made for those bytes, under
that fingerprint and hash; every tag has a fresh nonce, so no Poly1305 one-time key serves two messages."""

import hashlib
import os

from mesh.kvstore.block_tag import NONCE_BYTES, TAG_BYTES, BlockTagger

FINGERPRINT = "ab" * 32
BLOCK_BYTES = 4096


def blocks(n: int) -> tuple[list[bytes], bytes]:
    return [hashlib.sha256(b"block %d" % i).digest() for i in range(n)], os.urandom(n * BLOCK_BYTES)


def tag_all(tagger: BlockTagger, hashes: list[bytes], data: bytes, fingerprint: str = FINGERPRINT) -> bytes:
    return b"".join(
        tagger.tag(fingerprint, h, data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]) for i, h in enumerate(hashes)
    )


def test_blocks_tagged_under_the_key_verify():
    tagger = BlockTagger(os.urandom(32))
    hashes, data = blocks(4)
    tags = tag_all(tagger, hashes, data)
    assert len(tags) == 4 * TAG_BYTES
    assert tagger.verified(FINGERPRINT, hashes, data, tags, BLOCK_BYTES) == 4


def test_an_altered_byte_stops_the_load_at_its_block():
    tagger = BlockTagger(os.urandom(32))
    hashes, data = blocks(4)
    tags = tag_all(tagger, hashes, data)
    for position in (2 * BLOCK_BYTES, 2 * BLOCK_BYTES + 1234, 3 * BLOCK_BYTES - 1):
        altered = bytearray(data)
        altered[position] ^= 0x01
        assert tagger.verified(FINGERPRINT, hashes, altered, tags, BLOCK_BYTES) == 2


def test_a_tag_altered_or_forged_does_not_verify():
    tagger = BlockTagger(os.urandom(32))
    hashes, data = blocks(2)
    tags = tag_all(tagger, hashes, data)
    for position in (0, NONCE_BYTES - 1, NONCE_BYTES, TAG_BYTES - 1):  # the nonce, then the MAC
        altered = bytearray(tags)
        altered[TAG_BYTES + position] ^= 0x80
        assert tagger.verified(FINGERPRINT, hashes, data, bytes(altered), BLOCK_BYTES) == 1
    assert tagger.verified(FINGERPRINT, hashes, data, bytes(2 * TAG_BYTES), BLOCK_BYTES) == 0
    assert tagger.verified(FINGERPRINT, hashes, data, os.urandom(2 * TAG_BYTES), BLOCK_BYTES) == 0


def test_a_tag_holds_only_for_its_key_fingerprint_and_hash():
    tagger = BlockTagger(os.urandom(32))
    hashes, data = blocks(2)
    tags = tag_all(tagger, hashes, data)
    assert BlockTagger(os.urandom(32)).verified(FINGERPRINT, hashes, data, tags, BLOCK_BYTES) == 0
    assert tagger.verified("cd" * 32, hashes, data, tags, BLOCK_BYTES) == 0
    # the blocks swapped, each with its own tag: right bytes and tag, wrong hash
    swapped_data = data[BLOCK_BYTES:] + data[:BLOCK_BYTES]
    swapped_tags = tags[TAG_BYTES:] + tags[:TAG_BYTES]
    assert tagger.verified(FINGERPRINT, hashes, swapped_data, swapped_tags, BLOCK_BYTES) == 0


def test_every_tag_has_a_fresh_nonce_and_so_a_fresh_one_time_key():
    tagger = BlockTagger(os.urandom(32))
    (block_hash,), data = blocks(1)
    other = bytearray(data)
    other[0] ^= 1
    tags = [tagger.tag(FINGERPRINT, block_hash, d) for d in (data, data, bytes(other), bytes(other))]
    nonces = {t[:NONCE_BYTES] for t in tags}
    assert len(nonces) == len(tags)
    assert len({tagger.one_time_key(FINGERPRINT, block_hash, n) for n in nonces}) == len(tags)
    for t, d in zip(tags, (data, data, bytes(other), bytes(other))):
        assert tagger.verified(FINGERPRINT, [block_hash], d, t, BLOCK_BYTES) == 1
