"""The tag an engine puts on each KV block it stores: a random nonce, then a Poly1305 MAC of the block's bytes under a
one-time key, the HMAC-SHA256 under the mesh's block key of the layout's fingerprint, the block's hash and the nonce
(NaCl's construction: a key used once, derived by a PRF). An engine loads a block only when its tag verifies, so
neither the kvstore, nor Redis, nor anyone who can write to them can make an engine load a block that no engine
wrote: a forged or altered block is a miss, and its tokens are recomputed. Poly1305 reads a block several times
faster than SHA-256 does (a reload verifies every byte it loads); the nonce keeps two blocks stored under one hash,
with different bytes, from sharing a one-time key.

The key comes from $LLMMESH_KV_BLOCK_KEY (at least 64 hex digits), never from a command line, else from kv-block.key
in the mesh's credentials directory (`llmmesh certs` writes one). An engine with neither makes a key of its own: its
blocks then come back to it alone, until it restarts."""

import hmac
import logging
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from mesh.tls import default_tls_dir

logger = logging.getLogger("llmmesh.engine.kv_connector")

KEY_ENV = "LLMMESH_KV_BLOCK_KEY"
KEY_FILE = "kv-block.key"  # in the credentials directory
KEY_BYTES = 32
TAG_BYTES = 32
NONCE_BYTES = 16  # the tag's first half; the MAC is the second


def new_block_key() -> str:
    """A fresh key, as $LLMMESH_KV_BLOCK_KEY holds it."""
    return secrets.token_hex(KEY_BYTES)


def block_key_from_env() -> bytes:
    value = os.environ.get(KEY_ENV)
    if not value:
        path = Path(default_tls_dir()) / KEY_FILE
        value = path.read_text().strip() if path.is_file() else ""
    if not value:
        logger.warning(
            "$%s is unset and %s does not exist: this engine tags its KV blocks with a key of its own, so no other engine, "
            "and not itself after a restart, can load them from the store",
            KEY_ENV,
            path,
        )
        return secrets.token_bytes(KEY_BYTES)
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"${KEY_ENV} or {KEY_FILE} must be hex digits (at least {2 * KEY_BYTES})") from None
    if len(key) < KEY_BYTES:
        raise ValueError(f"${KEY_ENV} or {KEY_FILE} must be at least {2 * KEY_BYTES} hex digits; got {len(value)}")
    return key


class BlockTagger:
    def __init__(self, key: bytes):
        self.key = key

    def one_time_key(self, fingerprint: str, block_hash: bytes, nonce: bytes) -> bytes:
        return hmac.digest(self.key, fingerprint.encode() + block_hash + nonce, "sha256")

    def tag(self, fingerprint: str, block_hash: bytes, data) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + Poly1305.generate_tag(self.one_time_key(fingerprint, block_hash, nonce), data)

    def verified(self, fingerprint: str, block_hashes: list[bytes], data, tags: bytes, block_bytes: int) -> int:
        """How many of the blocks, back to back in data with their tags in tags, verify before the first that
        does not."""
        view = memoryview(data)
        for i, block_hash in enumerate(block_hashes):
            tag = tags[i * TAG_BYTES : (i + 1) * TAG_BYTES]
            key = self.one_time_key(fingerprint, block_hash, tag[:NONCE_BYTES])
            try:
                Poly1305.verify_tag(key, view[i * block_bytes : (i + 1) * block_bytes], tag[NONCE_BYTES:])
            except InvalidSignature:
                return i
        return len(block_hashes)
