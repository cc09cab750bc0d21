"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1) || canonical bytes of block i's tokens || extra keys).
The extra keys (block 0's, which every later block inherits through the chain) are the request's cache salt, its
LoRA adapter's digest, so requests under different adapters never share a block, and the rope its KV was rotated
with where a model has two (LongRoPE's long factors past the switch length); a request with none of them hashes as
it always did.
A block that holds any of an image's placeholder tokens also mixes in that image's content hash (vLLM's multi-modal
extra keys): the placeholders are the same token id whatever the image, so two prompts with the same text and
different images never share a block, while the same image in the same place does.
The encoding is fixed-width little-endian, so the same tokens give the same hash in every
process and on every machine; that is what lets a KV store share blocks across engines.
Never Python's hash() (salted per process) and never pickle.
"""

import hashlib
import struct
from collections.abc import Callable

import numpy as np

HashFn = Callable[[bytes], bytes]

HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "blake2b": lambda data: hashlib.blake2b(data, digest_size=32).digest(),
}


def get_hash_fn(algo: str) -> HashFn:
    if algo not in HASH_FUNCTIONS:
        raise ValueError(f"prefix_caching_hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got {algo!r}.")
    return HASH_FUNCTIONS[algo]


def root_hash(hash_fn: HashFn, seed: str | None = None) -> bytes:
    """The parent of every first block; a seed makes one deployment's hashes its own."""
    return hash_fn(b"llmmesh-prefix-cache-v1" + (seed or "").encode())


def hash_block_tokens(hash_fn: HashFn, parent_hash: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    tokens = np.asarray(token_ids, dtype="<i4").tobytes()
    return hash_fn(parent_hash + struct.pack("<I", len(token_ids)) + tokens + struct.pack("<I", len(extra)) + extra)


def request_extra_key(cache_salt: str | None, lora_key: bytes | None = None, rope_key: bytes | None = None) -> bytes:
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    lora = b"" if lora_key is None else b"lora:" + lora_key
    return salt + lora + (b"" if rope_key is None else b"rope:" + rope_key)


def mm_extra_key(mm_features, start: int, end: int) -> bytes:
    """The content hashes of the images whose placeholders overlap token positions [start, end)."""
    return b"".join(
        b"mm:" + f.identifier.encode()
        for f in mm_features
        if f.mm_position.offset < end and start < f.mm_position.offset + f.mm_position.length
    )


def extend_block_hashes(
    hashes: list[bytes],
    token_ids,
    block_size: int,
    hash_fn: HashFn,
    root: bytes,
    cache_salt: str | None,
    lora_key: bytes | None = None,
    rope_key: bytes | None = None,
    mm_features=(),
) -> list[bytes]:
    """Append to `hashes` the hash of every full block of `token_ids` past those already hashed (the salt, the
    adapter's digest, lora_key, and the rope's name, rope_key, are mixed into block 0 only; the images whose
    placeholders overlap a block, mm_features (each with .identifier and .mm_position), into that block). The
    engine names its blocks this way; a router names a prompt's blocks the same way."""
    num_full = len(token_ids) // block_size
    while len(hashes) < num_full:
        i = len(hashes)
        parent = hashes[-1] if hashes else root
        extra = request_extra_key(cache_salt, lora_key, rope_key) if i == 0 else b""
        if mm_features:
            extra += mm_extra_key(mm_features, i * block_size, (i + 1) * block_size)
        hashes.append(hash_block_tokens(hash_fn, parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes


def update_block_hashes(
    request,
    block_size: int,
    hash_fn: HashFn,
    root: bytes,
    lora_key: bytes | None = None,
    rope_key: bytes | None = None,
) -> None:
    """Append hashes for every newly full block of `request` (lora_key: the digest of its adapter, if any; rope_key:
    the name of the rope its KV is rotated with, where not the model's first)."""
    extend_block_hashes(
        request.block_hashes,
        request.all_token_ids,
        block_size,
        hash_fn,
        root,
        request.cache_salt,
        lora_key,
        rope_key,
        request.mm_features,
    )
