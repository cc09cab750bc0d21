"""KVEventPublisher: the KV cache's events (blocks stored, removed, all cleared) for subscribers on the event loop,
such as a router's prefix index. The engine thread takes each step's events; the loop publishes them as one
batch, numbered, to every subscriber's bounded queue and to a short history that a late subscriber can replay."""

import asyncio
import time
from collections import deque

# KV event batches a subscriber may fall behind by; past it the oldest are dropped (and counted).
KV_EVENT_QUEUE_SIZE = 1024
SNAPSHOT_BLOCKS_PER_EVENT = 16384  # block hashes in one event of a new KV event subscriber's snapshot (512 KiB)


class KVEventPublisher:
    """Used on the event loop, but for snapshot(), which runs on the engine thread."""

    def __init__(self):
        self.seq = 0  # one batch per step that had events
        self.history: deque[tuple[int, float, list]] = deque(maxlen=1024)
        self.subscribers: set[asyncio.Queue] = set()
        self.drops = 0  # batches dropped from subscribers that fell KV_EVENT_QUEUE_SIZE behind

    def subscribe(self) -> asyncio.Queue:
        """A queue of (seq, timestamp, events) batches from now on; unsubscribe() when done."""
        queue = asyncio.Queue(maxsize=KV_EVENT_QUEUE_SIZE)
        self.subscribers.add(queue)
        return queue

    def subscribe_from(self, batches: list) -> asyncio.Queue:
        """subscribe(), the queue starting with these batches (a snapshot())."""
        queue = self.subscribe()
        for batch in batches[: queue.maxsize]:
            queue.put_nowait(batch)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self.subscribers.discard(queue)

    def publish(self, events: list) -> None:
        """One step's events, as the next batch."""
        self.seq += 1
        batch = (self.seq, time.time(), events)
        self.history.append(batch)
        for subscriber in self.subscribers:
            if subscriber.full():  # a subscriber that does not keep up loses the oldest batch
                subscriber.get_nowait()
                self.drops += 1
            subscriber.put_nowait(batch)

    @staticmethod
    def snapshot(kv_cache_manager) -> list:
        """On the engine thread: the blocks cached now as batches numbered 0 (AllBlocksCleared, then BlockStored
        of their hashes), for a subscriber that starts from them."""
        events = kv_cache_manager.snapshot_events(SNAPSHOT_BLOCKS_PER_EVENT)
        return [(0, time.time(), [event]) for event in events]
