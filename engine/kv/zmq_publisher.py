"""ZmqEventPublisher: the KV cache's events in vLLM's wire format, for routers that subscribe to vLLM engines
(llm-d's precise prefix-cache scorer, Dynamo's KV router) with --kv-events-config.

The wire (vllm/distributed/kv_events.py): a PUB socket sends each step's events as one message of three frames,
the topic, the sequence number (8 bytes, big-endian, from 0) and a msgpack KVEventBatch; a ROUTER socket, if
configured, answers a request of 8 bytes (a sequence number) with every kept batch from that number on, one
message (sequence number, payload) each, then (-1, b""). The structs are array-like and tagged, as vLLM's were
before its events became maps: a batch is [ts, events, data_parallel_rank], an event ["BlockStored", hashes,
...]; consumers of the map form read the array form too. A block's hash is vLLM's integer form: the low 64 bits of the digest.

The engine thread only puts the step's events on a queue; the publisher thread converts, encodes and sends them,
and serves replays, so a slow subscriber never slows a step."""

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from engine.config.kv_events import KVEventsConfig
from engine.kv import block_pool

logger = logging.getLogger("llmmesh.engine")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message
MEDIUM_GPU = "GPU"  # vLLM's medium of the engine's own KV cache, on every platform


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The tag is the class name, first in the array."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: bytes) -> int:
    """vLLM's integer block hash on the wire: the digest's last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


def to_vllm_events(events: list) -> list[KVCacheEvent]:
    """engine.kv.block_pool's events as vLLM's structs. Blocks stored in the KV store are left out: the store is
    shared by every engine (a router would credit one engine with them) and its evictions are not events."""
    return [to_vllm_event(e) for e in events if not (isinstance(e, block_pool.BlockStored) and e.medium != "device")]


def to_vllm_event(event) -> KVCacheEvent:
    """An engine.kv.block_pool event (of the engine's own cache) as vLLM's struct."""
    if isinstance(event, block_pool.BlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=[external_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else external_block_hash(parent),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=MEDIUM_GPU,
            lora_name=event.lora_name,
            group_idx=event.group_id,
        )
    if isinstance(event, block_pool.BlockRemoved):
        return BlockRemoved([external_block_hash(h) for h in event.block_hashes], MEDIUM_GPU, event.group_id)
    return AllBlocksCleared()


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or a local transport) is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Sockets made here (a bind that fails fails the engine's start); used only by the publisher thread."""

    SHUTDOWN_TIMEOUT = 1.0

    def __init__(self, config: KVEventsConfig):
        self.queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.topic = config.topic.encode()
        self.seq = 0
        self.dropped = 0  # batches the full queue turned away
        self.context = zmq.Context.instance()
        self.pub = self.context.socket(zmq.PUB)
        self.replay = None
        try:
            self.pub.set_hwm(config.hwm)
            if is_bind_endpoint(config.endpoint):
                self.pub.bind(config.endpoint)
            else:
                self.pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self.replay = self.context.socket(zmq.ROUTER)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint} / {config.replay_endpoint}: {e}") from e
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the bound port, for a wildcard one
        self.running = True
        self.thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self.thread.start()

    def publish(self, events: list) -> None:
        """On the engine thread: one step's events (engine.kv.block_pool's), stamped now, as the next batch."""
        try:
            self.queue.put_nowait((time.time(), events))
        except queue.Full:  # the thread is far behind; vLLM would block the step here
            self.dropped += 1

    def shutdown(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT), then close the sockets."""
        if not self.running:
            return
        self.running = False
        self.thread.join(self.SHUTDOWN_TIMEOUT)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self.pub, self.replay):
            if socket is not None:
                socket.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self.running or not self.queue.empty():
            if self.replay is not None and self.replay.poll(0):
                # What the engine published before the request came is sent first, so a replay holds it.
                for _ in range(self.queue.qsize()):
                    self._send(encoder, *self.queue.get_nowait())
                self._serve_replay()
            try:
                ts, events = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            self._send(encoder, ts, events)

    def _send(self, encoder: msgspec.msgpack.Encoder, ts: float, events: list) -> None:
        payload = encoder.encode(KVEventBatch(ts=ts, events=to_vllm_events(events)))
        seq = self.seq
        self.seq += 1
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3:  # identity, empty delimiter (a REQ or DEALER's envelope), start sequence number
            logger.warning("KV events replay: a request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self.buffer:
            if seq >= start_seq:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_SEQ, b""))


def create_event_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The ZMQ publisher a config asks for; None for no config, events off, or publisher "null"."""
    return ZmqEventPublisher(config) if config is not None and config.publishes else None
