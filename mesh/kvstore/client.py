"""A blocking gRPC client for llmmesh.v1.KVStore that the KVStore connector calls from its own threads."""

from engine.kv.layout import KVLayout
from llmmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from mesh import tls
from mesh.grpc_policy import MAX_MESSAGE_BYTES
from mesh.kvstore.block_tag import TAG_BYTES
from mesh.kvstore.wire import SEGMENT_PREFIX, layout_to_proto
from mesh.shared_memory import create_segment, unlink_segment

# Blocks per Put message: well inside the message limit for any block that fits it at all.
_MESSAGE_TARGET_BYTES = 8 * 2**20


class Staging:
    """A shared-memory segment that a kvstore on this host writes a Get's blocks into (GetRequest.shared_memory):
    the engine then copies them into its cache from memory, where gRPC would carry them through both processes'
    buffers. Made once and reused for every Get; its name is unlinked once the kvstore has it mapped."""

    def __init__(self, num_blocks: int, block_bytes: int):
        self.name, self.mmap = create_segment(SEGMENT_PREFIX, num_blocks * block_bytes)
        self.view = memoryview(self.mmap)
        self.num_blocks = num_blocks
        self.linked = True  # the name exists: nothing has mapped it yet, or it was never unlinked
        self.taken = False  # the last Get's blocks came through it

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            unlink_segment(self.name)

    def close(self) -> None:
        self.unlink()
        self.view = self.mmap = None  # unmapped once no copy still reads it


class KVStoreClient:
    """Blocking calls with a deadline each; any failure raises grpc.RpcError (or ValueError for a bad reply).
    metadata: the gRPC metadata of the call (the traceparent of the request it is for, when traced). Each call moves
    blocks of one layout (one KV cache group's)."""

    def __init__(self, address: str, layouts: list[KVLayout]):
        self.address = address
        for layout in layouts:
            if layout.block_bytes > MAX_MESSAGE_BYTES // 2:
                raise ValueError(f"a KV block of {layout.block_bytes} bytes is too large for the kvstore's messages")
        # Always inside an engine: it presents the engine's certificate.
        self.channel = tls.channel(address, "kvstore", tls.credentials_from_env("engine"))
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel)

    def lookup(self, fingerprint: str, block_hashes: list[bytes], timeout: float, metadata=()) -> list[bool]:
        """Whether the store holds each of the blocks under this fingerprint."""
        request = kvstore_pb2.LookupRequest(fingerprint=fingerprint, block_hashes=block_hashes)
        response = self.stub.Lookup(request, timeout=timeout, metadata=metadata)
        if len(response.present) != len(block_hashes):  # a kvstore that answers the leading run only
            return [i < response.num_present for i in range(len(block_hashes))]
        return list(response.present)

    def get(
        self, layout: KVLayout, block_hashes: list[bytes], timeout: float, metadata=(), staging: Staging | None = None
    ):
        """Yield the blocks' bytes and their tags in order, several blocks back to back at a time, until the first
        missing block; more bytes than asked for, part of a block, or tags that do not match the blocks end it. With staging (room for the blocks), a kvstore that
        maps it writes the blocks there: what is yielded is then staging's memory, good until the next Get into
        it, and staging.taken is set."""
        request = kvstore_pb2.GetRequest(layout=layout_to_proto(layout), block_hashes=block_hashes)
        if staging is not None:
            assert len(block_hashes) <= staging.num_blocks
            request.shared_memory, staging.taken = staging.name, False
        block_bytes = layout.block_bytes
        left, offset = len(block_hashes) * block_bytes, 0
        for response in self.stub.Get(request, timeout=timeout, metadata=metadata):
            if response.num_blocks:
                if staging is None:
                    raise ValueError("the kvstore answered num_blocks to a Get without shared memory")
                size = response.num_blocks * block_bytes
                data, staging.taken = staging.view[offset : offset + size], True
                offset += size
            else:
                data = response.data  # each access copies the bytes
            if (
                len(data) % block_bytes
                or len(data) > left
                or len(response.tags) != len(data) // block_bytes * TAG_BYTES
            ):
                raise ValueError("the kvstore answered part of a block, more blocks than asked for, or other tags")
            left -= len(data)
            yield data, response.tags

    def put(self, layout: KVLayout, blocks, timeout: float, metadata=()) -> int:
        """Store (hash, data, tag) triples, several per message; the number stored (present ones are skipped)."""
        proto_layout = layout_to_proto(layout)
        blocks_per_message = max(1, _MESSAGE_TARGET_BYTES // layout.block_bytes)

        def messages():
            batch, first = [], True
            for block_hash, data, tag in blocks:
                batch.append(kvstore_pb2.KVBlock(block_hash=block_hash, data=data, tag=tag))
                if len(batch) == blocks_per_message:
                    yield kvstore_pb2.PutRequest(layout=proto_layout if first else None, blocks=batch)
                    batch, first = [], False
            if batch or first:
                yield kvstore_pb2.PutRequest(layout=proto_layout if first else None, blocks=batch)

        return self.stub.Put(messages(), timeout=timeout, metadata=metadata).num_stored

    def close(self) -> None:
        self.channel.close()
