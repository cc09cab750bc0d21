"""How the kvstore keeps a KV block in Redis: under `kv:{fingerprint}:{block hash in hex}`, a small header (magic,
version, dtype, shape, layer count, block size, data length), the writing engine's tag (KVBlock.tag, kept as it
came: the kvstore cannot check it), the CRC-32C of the tag and data, then the raw bytes."""

import math
import re
import struct

from crc32c import crc32c  # the CPU's CRC32 instruction: far faster than zlib's CRC-32 on KV blocks

from llmmesh.v1 import kvstore_pb2

# name -> (code in the header, bytes): the KV cache dtypes (engine.kv.layout.DTYPE_SIZES)
DTYPES = {"float32": (1, 4), "float16": (2, 2), "bfloat16": (3, 2), "float8_e4m3fn": (4, 1), "float8_e5m2": (5, 1)}
MAGIC, VERSION = b"LMKV", 4  # version 3's tags are HMAC-SHA256s, 2's blocks carry none, 1's CRC is zlib's
TAG_BYTES = 32  # KVBlock.tag: a nonce and a Poly1305 MAC (mesh/kvstore/block_tag.py)
MAX_DIMS = 8
FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_CRC = struct.Struct("<I")


def block_key(fingerprint: str, block_hash: bytes) -> str:
    return f"kv:{fingerprint}:{block_hash.hex()}"


def check_fingerprint(fingerprint: str, field: str) -> str:
    if not FINGERPRINT.fullmatch(fingerprint):
        raise ValueError(f"{field} must be 64 lowercase hex characters (a sha256 digest); got {fingerprint[:80]!r}")
    return fingerprint


class Layout:
    """A checked BlockLayout: the header every value stored under it starts with, and its data size."""

    def __init__(self, layout: kvstore_pb2.BlockLayout, max_block_bytes: int):
        self.fingerprint = check_fingerprint(layout.fingerprint, "layout.fingerprint")
        if layout.dtype not in DTYPES:
            raise ValueError(f"layout.dtype must be one of {', '.join(DTYPES)}; got {layout.dtype[:32]!r}")
        shape = list(layout.shape)
        if not 1 <= len(shape) <= MAX_DIMS:
            raise ValueError(f"layout.shape must have 1 to {MAX_DIMS} dimensions; got {len(shape)}")
        for i, dim in enumerate(shape):
            if dim < 1:
                raise ValueError(f"layout.shape[{i}] must be at least 1; got {dim}")
        code, itemsize = DTYPES[layout.dtype]
        self.nbytes = math.prod(shape) * itemsize  # a Python int of at most 8 dims: nothing is allocated
        if self.nbytes > max_block_bytes:
            raise ValueError(
                f"layout.shape {shape} of {layout.dtype} is {self.nbytes} bytes a block; at most "
                f"{max_block_bytes} are allowed (--max-block-bytes)"
            )
        for name in ("num_layers", "block_size"):
            if getattr(layout, name) < 1:
                raise ValueError(f"layout.{name} must be at least 1; got 0")
        self.header = struct.pack(
            f"<4sBBB{len(shape)}IIIQ",
            MAGIC,
            VERSION,
            code,
            len(shape),
            *shape,
            layout.num_layers,
            layout.block_size,
            self.nbytes,
        )

    def key(self, block_hash: bytes) -> str:
        return block_key(self.fingerprint, block_hash)

    @property
    def prefix_bytes(self) -> int:
        """The bytes of a stored value before its data: the header, the tag and the checksum."""
        return len(self.header) + TAG_BYTES + _CRC.size

    def encode(self, data: bytes, tag: bytes) -> bytes:
        return b"".join((self.header, tag, _CRC.pack(crc32c(data, crc32c(tag))), data))

    def check(self, prefix: bytes, data: memoryview) -> bool:
        """Whether a value's prefix is this layout's header with the checksum of its tag and data."""
        tag = self.tag(prefix)
        crc = _CRC.unpack_from(prefix, len(self.header) + TAG_BYTES)[0]
        return prefix.startswith(self.header) and crc == crc32c(data, crc32c(tag))

    def tag(self, prefix: bytes) -> bytes:
        """The tag a value's prefix holds."""
        return prefix[len(self.header) : len(self.header) + TAG_BYTES]
