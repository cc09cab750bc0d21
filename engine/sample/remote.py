"""RemoteSampler: the engine's client of the sampler service (llmmesh.v1.Sampler), one step at a time.

One bidirectional stream per engine. Each step sends the logits of the rows that sample (raw bytes in the
model's dtype, so the service samples exactly what the engine would have) and, per row, only what changed
since that request's last step: its sampling parameters the first time, then the output tokens appended
since. Requests that finished are forgotten in the next message. Prompt-logprob rows go the same way,
split over several messages when they are many. Blocking: the engine thread waits for each reply, at most
`timeout` seconds; any failure ends the stream (the service forgets its requests) and raises
SamplerUnavailableError, naming the other requests whose seeded generator is lost with it (the engine fails
them too: a seed must give in-process sampling's tokens or nothing), and the next step opens a new one. Given a
fallback (--sampler-fallback: a LocalSampler), a step the service cannot serve samples there instead.

With slot_bytes, each stream opens with an offer of shared memory (engine.sample.slots: host memory, or the
GPU's through CUDA IPC): a service on this host takes it, and from then on a step's logits are written once into
a slot and the message carries only the slot, its generation, dtype and shape. A service that cannot map it
(another host, another user, another GPU), or an engine that cannot make it, keeps the bytes. A new stream
makes a new segment.
"""

import logging
import queue
import threading

import grpc
import torch

from engine.grpc_policy import CHANNEL_OPTIONS
from engine.request import RequestFailure
from engine.sample.rejection_sampler import pad_token_rows
from engine.sample.sampler import BatchSampler, LogprobsTensors, SamplerOutput, SamplerUnavailableError
from engine.sample.slots import SharedSlots
from engine.sample.wire import (
    DTYPE_NAMES,
    drafts_to_proto,
    grammar_bitmask_to_proto,
    logprobs_tensors_from_proto,
    new_request_to_proto,
    serialize_with_tensors,
)
from llmmesh.v1 import sampler_pb2

logger = logging.getLogger("llmmesh.engine")

_SAMPLE_METHOD = "/llmmesh.v1.Sampler/Sample"
# Prompt-logprob rows per message: up to about this many bytes of logits.
MESSAGE_TARGET_BYTES = 32 * 2**20
# Shared-memory slots per stream: one step is in flight at a time, so one is read while the next can be written.
NUM_SLOTS = 2
_END = object()


class _Stream:
    """One Sample call: what to send goes on `outbox`, a reader thread puts replies (or the error) in `replies`."""

    def __init__(self, channel: grpc.Channel):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        # (SampleStep, its logits, its prompt logits): the tensors are written into the message's bytes directly.
        sample = channel.stream_stream(
            _SAMPLE_METHOD, request_serializer=_serialize, response_deserializer=sampler_pb2.SampleResult.FromString
        )
        self.call = sample(iter(self.outbox.get, _END))
        threading.Thread(target=self._read, name="sampler-replies", daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.put(reply)
            self.replies.put(RuntimeError("the sampler ended the stream"))
        except grpc.RpcError as e:
            self.replies.put(e)

    def close(self) -> None:
        self.outbox.put(_END)
        self.call.cancel()


class RemoteSampler(BatchSampler):
    def __init__(
        self,
        address: str,
        timeout: float = 10.0,
        fallback: BatchSampler | None = None,
        slot_bytes: int = 0,
        device: torch.device | str = "cpu",
    ):
        """slot_bytes: the most a step's logits take (rows * vocab * itemsize), for shared-memory slots of that
        size; 0: logits always go as bytes. device: where the logits are (a GPU's stay there)."""
        self.address = address
        self.timeout = timeout
        self.fallback = fallback
        self.slot_bytes = slot_bytes
        self.device = torch.device(device)
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stream: _Stream | None = None
        self.slots: SharedSlots | None = None  # this stream's, when the service took them
        self._sent: dict[str, int] = {}  # request id -> output tokens the service has of it
        self._seeded: set[str] = set()  # those of them with a generator on the service
        self._finished: list[str] = []  # known requests to forget in the next message
        self._step_id = 0

    def forget(self, request_ids) -> None:
        if self.fallback is not None:
            self.fallback.forget(request_ids)
        for request_id in request_ids:
            if self._sent.pop(request_id, None) is not None:
                self._seeded.discard(request_id)
                self._finished.append(request_id)

    def sample(self, requests, logits, prompt_chunks, grammar=None, drafts=None, while_waiting=None):
        try:
            return self._sample(requests, logits, prompt_chunks, grammar, drafts, while_waiting)
        except SamplerUnavailableError as e:
            if self.fallback is None:
                raise
            logger.warning("%s; sampling this step in process", e)
            return self.fallback.sample(requests, logits, prompt_chunks, grammar, drafts)

    def _sample(self, requests, logits, prompt_chunks, grammar, drafts, while_waiting):
        try:
            if self._stream is None:
                self._stream = _Stream(self.channel)
                self.slots = self._offer_shared_memory()
            pieces = list(_split_prompt_chunks(prompt_chunks))
            batches = _pack(pieces)
            replies = [self._exchange(*self._prompt_message(batch), None) for batch in batches[:-1]]
            last, prompt_logits = self._prompt_message(batches[-1])
            self._add_rows(last, requests)
            grammar_bitmask_to_proto(last, grammar)
            drafts_to_proto(last, drafts)
            shared = self._write_slot(last, logits) if requests else None
            replies.append(
                self._exchange(last, prompt_logits, logits if requests and shared is None else None, while_waiting)
            )
            if shared is not None and not self.slots.released(*shared):
                raise SamplerUnavailableError(f"the sampler at {self.address} answered before releasing slot {shared}")
            results = [logprobs_tensors_from_proto(lp, "prompt_logprobs") for r in replies for lp in r.prompt_logprobs]
            reply = replies[-1]
            logprobs = logprobs_tensors_from_proto(reply.logprobs, "logprobs") if reply.HasField("logprobs") else None
        except (SamplerUnavailableError, ValueError) as e:  # ValueError: a reply that does not decode
            lost = self._seeded - {r.request_id for r in requests}
            self.reset()
            raise SamplerUnavailableError(str(e), sorted(lost)) from None
        for request in requests:
            self._sent[request.request_id] = request.num_output_tokens
            p = request.sampling_params
            if p.seed is not None and not p.greedy:
                self._seeded.add(request.request_id)
        prompt_results = _join_pieces(pieces, results, len(prompt_chunks))
        if not requests:
            return None, prompt_results
        failed = {f.row: RequestFailure(f.message, f.invalid_input) for f in reply.failed}
        sampled = torch.tensor(list(reply.sampled_token_ids), dtype=torch.int64)
        if drafts is not None:  # each request's tokens, as the in-process rejection sampler lays them out
            sampled = pad_token_rows(sampled.split(list(reply.num_sampled_tokens)), max(drafts.num_positions))
        return SamplerOutput(sampled, logprobs, failed), prompt_results

    def reset(self) -> None:
        """End the stream: the service forgets every request, the next step starts a new stream (and segment)."""
        if self._stream is not None:
            self._stream.close()
        self._stream = None
        if self.slots is not None:
            self.slots.close()  # a sampler still reading keeps its own mapping; this side never writes it again
            self.slots = None
        self._sent.clear()
        self._seeded.clear()
        self._finished.clear()

    def close(self) -> None:
        self.reset()
        self.channel.close()

    # ---- one message ---------------------------------------------------------------------------------

    def _offer_shared_memory(self) -> SharedSlots | None:
        """The stream's first message: the offer of slots; the slots if the service took them."""
        if not self.slot_bytes:
            return None
        try:
            slots = SharedSlots.for_device(NUM_SLOTS, self.slot_bytes, self.device)
        except (OSError, RuntimeError) as e:  # RuntimeError: the GPU's memory
            logger.warning("no shared memory for the sampler's logits (%s): they go as bytes", e)
            return None
        try:
            offer = slots.offer()
        except RuntimeError as e:  # CUDA IPC refused
            logger.warning("the logits' device memory cannot be shared (%s): they go as bytes", e)
            slots.close()
            return None
        try:
            msg, _ = self._prompt_message([])
            msg.ClearField("trace_context")  # the offer is no step: the service traces none for it
            msg.shared_memory.CopyFrom(offer)
            form = self._exchange(msg, None, None).logits_form
        finally:
            slots.unlink()  # both ends have it open (or the service declined): nothing else may open it
        if form != slots.form:
            logger.info("the sampler at %s cannot share this host's memory: logits go as bytes", self.address)
            slots.close()
            return None
        name = sampler_pb2.LogitsForm.Name(form)
        logger.info("the sampler at %s reads the logits in place (%s)", self.address, name)
        return slots

    def _write_slot(self, msg: sampler_pb2.SampleStep, logits: torch.Tensor) -> tuple[int, int] | None:
        """Logits into a free slot, named in msg; None (they go as bytes) without slots or one that fits."""
        shared = self.slots.write(logits) if self.slots is not None else None
        if shared is not None:
            slot, generation = shared
            msg.shared_logits.CopyFrom(
                sampler_pb2.SharedLogits(
                    slot=slot, generation=generation, dtype=DTYPE_NAMES[logits.dtype], shape=logits.shape
                )
            )
        return shared

    def _prompt_message(self, pieces) -> tuple[sampler_pb2.SampleStep, torch.Tensor | None]:
        self._step_id += 1
        msg = sampler_pb2.SampleStep(
            step_id=self._step_id, finished_request_ids=self._finished, trace_context=dict(self.trace_headers)
        )
        self._finished = []
        if pieces:
            msg.prompt_num_logprobs.extend(k for _, _, k, _ in pieces)
            msg.prompt_num_targets.extend(len(t) for _, _, _, t in pieces)
            msg.prompt_target_ids.extend(torch.cat([t for _, _, _, t in pieces]).tolist())
            return msg, torch.cat([lg for _, lg, _, _ in pieces])
        return msg, None

    def _add_rows(self, msg: sampler_pb2.SampleStep, requests: list) -> None:
        for request in requests:
            sent = self._sent.get(request.request_id)
            if sent is None:
                msg.new_requests.append(new_request_to_proto(request))
                sent = 0
            new = request.output_token_ids[sent:]
            msg.request_ids.append(request.request_id)
            msg.num_new_tokens.append(len(new))
            msg.new_token_ids.extend(new)

    def _exchange(
        self, msg: sampler_pb2.SampleStep, prompt_logits, logits, while_waiting=None
    ) -> sampler_pb2.SampleResult:
        stream = self._stream
        stream.outbox.put((msg, logits, prompt_logits))
        if while_waiting is not None:
            while_waiting()
        try:
            reply = stream.replies.get(timeout=self.timeout)
        except queue.Empty:
            raise SamplerUnavailableError(
                f"the sampler at {self.address} did not answer within {self.timeout:g} s"
            ) from None
        if isinstance(reply, grpc.RpcError):
            raise SamplerUnavailableError(
                f"the sampler at {self.address} failed: {reply.code().name}: {reply.details()}"
            )
        if isinstance(reply, Exception):
            raise SamplerUnavailableError(f"the sampler at {self.address} failed: {reply}")
        num_rows = len(reply.num_sampled_tokens) if msg.num_draft_tokens else len(reply.sampled_token_ids)
        got = (reply.step_id, num_rows, len(reply.prompt_logprobs))
        expected = (msg.step_id, len(msg.request_ids), len(msg.prompt_num_targets))
        if got != expected:
            raise SamplerUnavailableError(
                f"the sampler at {self.address} answered (step, tokens, prompt chunks) {got}; expected {expected}"
            )
        return reply


def _serialize(item) -> bytes:
    msg, logits, prompt_logits = item
    return serialize_with_tensors(msg, {"logits": logits, "prompt_logits": prompt_logits})


def _split_prompt_chunks(chunks):
    """(chunk index, logits, k, targets) pieces of at most MESSAGE_TARGET_BYTES of logits each (at least one row);
    logprobs are row by row, so pieces join back into exactly the chunk's result."""
    for index, (logits, k, targets) in enumerate(chunks):
        rows = max(1, MESSAGE_TARGET_BYTES // max(1, logits[0].numel() * logits.element_size()))
        for start in range(0, len(logits), rows):
            yield index, logits[start : start + rows], k, targets[start : start + rows]


def _pack(pieces) -> list[list]:
    """Pieces into messages of about MESSAGE_TARGET_BYTES each; always at least one (the last carries the rows)."""
    batches, batch, size = [], [], 0
    for piece in pieces:
        nbytes = piece[1].numel() * piece[1].element_size()
        if batch and size + nbytes > MESSAGE_TARGET_BYTES:
            batches.append(batch)
            batch, size = [], 0
        batch.append(piece)
        size += nbytes
    batches.append(batch)
    return batches


def _join_pieces(pieces, results, num_chunks: int) -> list[LogprobsTensors]:
    parts: list[list] = [[] for _ in range(num_chunks)]
    for (index, *_), result in zip(pieces, results):
        parts[index].append(result)
    return [
        LogprobsTensors(*(torch.cat(column) for column in zip(*((r.token_ids, r.logprobs, r.ranks) for r in p))))
        for p in parts
    ]
