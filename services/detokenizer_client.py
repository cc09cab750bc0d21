"""DetokenizerStream: the gateway's one bidirectional stream to the Detokenizer, shared by many requests.

Items sent in the same event-loop turn leave together, in DetokenizeBatches of at most max_batch items (the
detokenizer refuses a larger one, which would end the stream for every request on it), so concurrent requests'
steps travel together. Sending never waits for an answer: the detokenizer answers every item with one result, in
order, and each result goes to the queue its request opened. When the stream breaks (the detokenizer
went away), every open queue gets a RequestError; the gateway opens a new stream for the next requests.
"""

import asyncio

import grpc

from llmmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc
from services.errors import RequestError, unavailable


class DetokenizerStream:
    def __init__(self, stub: detokenizer_pb2_grpc.DetokenizerStub, address: str, max_batch: int):
        self.address = address
        self.max_batch = max_batch
        self.error: RequestError | None = None
        self.outbox: list[detokenizer_pb2.DetokenizeItem] = []
        self.has_items = asyncio.Event()
        self.queues: dict[str, asyncio.Queue] = {}  # detokenizer request id -> its request's result queue
        self.call = stub.Detokenize(self._batches())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _batches(self):
        while True:
            await self.has_items.wait()
            self.has_items.clear()
            items, self.outbox = self.outbox, []
            for start in range(0, len(items), self.max_batch):
                yield detokenizer_pb2.DetokenizeBatch(items=items[start : start + self.max_batch])

    async def _read(self) -> None:
        reason = "the stream ended"
        try:
            async for batch in self.call:
                for result in batch.results:
                    queue = self.queues.get(result.request_id)
                    if queue is not None:
                        queue.put_nowait(result)
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            reason = "the stream was cancelled"
        self.error = unavailable(f"the detokenizer at {self.address} is unavailable: {reason}")
        for queue in set(self.queues.values()):  # wake every waiting request: its state is gone with the stream
            queue.put_nowait(self.error)

    def open(self, detok_ids: list[str], queue: asyncio.Queue) -> None:
        """Results for these ids go to queue from now on."""
        if self.error is not None:
            raise self.error
        for detok_id in detok_ids:
            self.queues[detok_id] = queue

    def send(self, items: list[detokenizer_pb2.DetokenizeItem]) -> None:
        if items and self.error is None:
            self.outbox.extend(items)
            self.has_items.set()

    def close(self, detok_id: str, forget_remote: bool) -> None:
        """Stop routing a request's results; forget_remote: also tell the detokenizer to drop its state."""
        if self.queues.pop(detok_id, None) is not None and forget_remote:
            self.send([detokenizer_pb2.DetokenizeItem(request_id=detok_id, close=True)])

    def cancel(self) -> None:
        self.call.cancel()
