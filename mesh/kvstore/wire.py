"""The kvstore's wire form (llmmesh.v1.KVStore), shared by the engine's connector client and the kvstore service."""

from engine.kv.layout import KVLayout
from llmmesh.v1 import kvstore_pb2

# A shared-memory segment the engine offers a Get (GetRequest.shared_memory) is named this, then 32 hex digits.
SEGMENT_PREFIX = "llmmesh-kv"


def layout_to_proto(layout: KVLayout) -> kvstore_pb2.BlockLayout:
    return kvstore_pb2.BlockLayout(
        fingerprint=layout.fingerprint,
        dtype=layout.dtype,
        shape=list(layout.shape),
        num_layers=layout.num_layers,
        block_size=layout.block_size,
    )
