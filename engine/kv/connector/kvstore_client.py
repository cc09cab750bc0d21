"""The engine's side of the kvstore wire: what a block is (KVLayout, its fingerprint) and a blocking
gRPC client for llmmesh.v1.KVStore that the connector calls from its own threads."""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import grpc
from llmmesh.v1 import kvstore_pb2, kvstore_pb2_grpc

from engine.grpc_policy import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES

# Blocks per Put or Get message: well inside the message limit for any block that fits it at all.
_MESSAGE_TARGET_BYTES = 8 * 2**20
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    """One block as the store sees it: raw bytes of `shape` = [layers, 2 (K, V), kv heads, block size, head dim]."""

    fingerprint: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def block_size(self) -> int:
        return self.shape[3]

    @property
    def block_bytes(self) -> int:
        n = _DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_proto(self) -> kvstore_pb2.BlockLayout:
        return kvstore_pb2.BlockLayout(
            fingerprint=self.fingerprint, dtype=self.dtype, shape=list(self.shape),
            num_layers=self.num_layers, block_size=self.block_size,
        )  # fmt: skip


def weights_digest(model_dir: Path) -> str:
    """sha256 over the config and every weight file, cached beside them by size and modification time."""
    files = sorted(
        p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors", ".gguf") and not p.name.startswith(".")
    )
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    cache = model_dir / ".llmmesh-weights-digest.json"
    try:
        saved = json.loads(cache.read_text())
        if saved["stamp"] == [list(s) for s in stamp]:
            return saved["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    value = digest.hexdigest()
    try:
        cache.write_text(json.dumps({"stamp": stamp, "digest": value}))
    except OSError:
        pass  # a read-only model directory: hash again next time
    return value


def model_fingerprint(weights: str, dtype: str, kv_layout: str, shape: tuple[int, ...], hash_algo: str,
                      rank: int = 0, world_size: int = 1) -> str:
    """64 hex characters naming everything that makes two engines' blocks interchangeable."""
    identity = {"weights": weights, "dtype": dtype, "kv_layout": kv_layout, "shape": list(shape),
                "hash_algo": hash_algo, "rank": rank, "world_size": world_size}  # fmt: skip
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class KVStoreClient:
    """Blocking calls with a deadline each; any failure raises grpc.RpcError (or ValueError for a bad reply).
    metadata: the gRPC metadata of the call (the traceparent of the request it is for, when traced)."""

    def __init__(self, address: str, layout: KVLayout):
        self.address = address
        self.layout = layout
        self._proto_layout = layout.to_proto()
        if layout.block_bytes > MAX_MESSAGE_BYTES // 2:
            raise ValueError(f"a KV block of {layout.block_bytes} bytes is too large for the kvstore's messages")
        self.blocks_per_message = max(1, _MESSAGE_TARGET_BYTES // layout.block_bytes)
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel)

    def lookup(self, block_hashes: list[bytes], timeout: float, metadata=()) -> int:
        request = kvstore_pb2.LookupRequest(fingerprint=self.layout.fingerprint, block_hashes=block_hashes)
        return min(self.stub.Lookup(request, timeout=timeout, metadata=metadata).num_present, len(block_hashes))

    def get(self, block_hashes: list[bytes], timeout: float, metadata=()):
        """Yield (block hash, data) in order until the first missing block; a block of the wrong size ends it."""
        request = kvstore_pb2.GetRequest(layout=self._proto_layout, block_hashes=block_hashes)
        expected = iter(block_hashes)
        for response in self.stub.Get(request, timeout=timeout, metadata=metadata):
            for block in response.blocks:
                if block.block_hash != next(expected, None) or len(block.data) != self.layout.block_bytes:
                    raise ValueError("the kvstore answered a block out of order or of the wrong size")
                yield block.block_hash, block.data

    def put(self, blocks, timeout: float, metadata=()) -> int:
        """Store (hash, data) pairs, several per message; the number stored (present ones are skipped)."""

        def messages():
            batch, first = [], True
            for block_hash, data in blocks:
                batch.append(kvstore_pb2.KVBlock(block_hash=block_hash, data=data))
                if len(batch) == self.blocks_per_message:
                    yield kvstore_pb2.PutRequest(layout=self._proto_layout if first else None, blocks=batch)
                    batch, first = [], False
            if batch or first:
                yield kvstore_pb2.PutRequest(layout=self._proto_layout if first else None, blocks=batch)

        return self.stub.Put(messages(), timeout=timeout, metadata=metadata).num_stored

    def close(self) -> None:
        self.channel.close()
