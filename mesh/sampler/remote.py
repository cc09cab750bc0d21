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

With slot_bytes, each stream opens with an offer of shared memory (mesh.sampler.slots: host memory, or the
GPU's through CUDA IPC): a service on this host takes it, and from then on a step's logits are written once into
a slot and the message carries only the slot, its generation, dtype and shape. A service that cannot map it
(another host, another user, another GPU), or an engine that cannot make it, keeps the bytes. A new stream
makes a new segment.

The offer also names a step channel (mesh.sampler.channel): a service that takes the slots and can connect to it
gets every later step and answers over that Unix socket, the engine thread writing and waiting itself, and the
stream stays open, idle; a service that cannot keeps the stream for its steps. A new stream makes a new channel.
Over the channel, a step whose rows all take their raw logits' argmax goes as a greedy step: the slot and the shape
alone, answered outside the service's interpreter. A step whose rows are shaped by temperature, min-p, top-k and
top-p alone (engine.sample.metadata.plain_sampling) goes as a sampled step: the same, with each row's settings and
its token's index (PLAIN_ROW), sampled there as the Sampler samples it (a seeded row's draw depends on its seed and
that index alone, so it needs no state on the service either).
"""

import logging
import operator
import queue
import struct
import threading
import time

import grpc
import torch
from google.protobuf.message import DecodeError

from engine.request import RequestFailure
from engine.sample.metadata import argmax_only, plain_sampling
from engine.sample.ops import MASK64
from engine.sample.rejection_sampler import pad_token_rows
from engine.sample.sampler import BatchSampler, LogprobsTensors, SamplerOutput, SamplerUnavailableError
from kernels.cpu_ops import try_load
from llmmesh.v1 import sampler_pb2
from mesh import tls
from mesh.sampler.channel import GREEDY_DTYPES, ChannelClosedError, ChannelListener, StepChannel
from mesh.sampler.slots import SharedSlots
from mesh.sampler.wire import (
    DTYPE_NAMES,
    drafts_to_proto,
    grammar_bitmask_to_proto,
    logprobs_tensors_from_proto,
    new_request_to_proto,
    serialize_with_tensors,
)

logger = logging.getLogger("llmmesh.engine")

_SAMPLE_METHOD = "/llmmesh.v1.Sampler/Sample"
# Prompt-logprob rows per message: up to about this many bytes of logits.
MESSAGE_TARGET_BYTES = 32 * 2**20
# Shared-memory slots per stream: one step is in flight at a time, so one is read while the next can be written.
NUM_SLOTS = 2
_END = object()
# A sampled step's row (kernels/cpu/plain_sampling.h's PlainRow): temperature, top_p, min_p, top_k, seed mod 2**64,
# flags, then (_INDEX) the index of the token it samples in its request's output.
PLAIN_ROW = struct.Struct("<fffiQI4x")
_INDEX = struct.Struct("<Q")
# PlainRow's flags: the decisions the Sampler takes on the settings' Python values.
GREEDY, SEEDED, TEMPERATURE, TOP_P, MIN_P = 1, 2, 4, 8, 16


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
        step_channel: bool = True,
    ):
        """slot_bytes: the most a step's logits take (rows * vocab * itemsize), for shared-memory slots of that
        size; 0: logits always go as bytes. device: where the logits are (a GPU's stay there). step_channel: offer
        one with the slots (False: steps stay on the stream, as from another host)."""
        self.address = address
        self.timeout = timeout
        self.fallback = fallback
        self.slot_bytes = slot_bytes
        self.device = torch.device(device)
        self.offer_step_channel = step_channel
        # Always inside an engine: it presents the engine's certificate.
        self.channel = tls.channel(address, "sampler", tls.credentials_from_env("engine"))
        self._stream: _Stream | None = None
        self.slots: SharedSlots | None = None  # this stream's, when the service took them
        self.step_channel: StepChannel | None = None  # this stream's, when the service connected to it
        # (the CPU kernels, the slots' headers, their data), when the service answers greedy steps on the channel
        self._greedy_views = None
        self.num_greedy_steps = 0
        self.num_sampled_steps = 0
        self._plain_rows: list = []  # the last greedy or sampled step's requests, in order
        self._row_settings: list[bytes] | None = None  # their PLAIN_ROW settings; None: a greedy step's
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

    def sample(self, requests, logits, prompt_chunks, grammar=None, drafts=None, while_waiting=None, trace_headers=()):
        try:
            return self._sample(requests, logits, prompt_chunks, grammar, drafts, while_waiting, trace_headers)
        except SamplerUnavailableError as e:
            if self.fallback is None:
                raise
            logger.warning("%s; sampling this step in process", e)
            return self.fallback.sample(requests, logits, prompt_chunks, grammar, drafts)

    def _sample(self, requests, logits, prompt_chunks, grammar, drafts, while_waiting, trace_headers):
        try:
            if self._stream is None:
                self._stream = _Stream(self.channel)
                self.slots = self._offer_shared_memory()
            rows = self._fast_step_rows(requests, logits, prompt_chunks, grammar, drafts, trace_headers)
            if rows is not None:
                sampled = self._fast_step(logits, rows, while_waiting)
                if sampled is not None:
                    return SamplerOutput(sampled, None, {}), []
            pieces = list(_split_prompt_chunks(prompt_chunks))
            batches = _pack(pieces)
            replies = [self._exchange(*self._prompt_message(batch, trace_headers), None) for batch in batches[:-1]]
            last, prompt_logits = self._prompt_message(batches[-1], trace_headers)
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
        if self.step_channel is not None:
            self.step_channel.close()
            self.step_channel = None
        if self._stream is not None:
            self._stream.close()
        self._stream = None
        if self.slots is not None:
            self.slots.close()  # a sampler still reading keeps its own mapping; this side never writes it again
            self.slots = None
        self._greedy_views = None
        self._plain_rows = []
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
        listener = None
        if self.offer_step_channel:
            try:
                listener = ChannelListener()
                offer.step_socket = listener.path
            except OSError as e:  # no room for a socket's name under the temporary directory
                logger.warning("no step channel for the sampler (%s): steps go over the stream", e)
        try:
            msg, _ = self._prompt_message([], ())  # the offer is no step: the service traces none for it
            msg.shared_memory.CopyFrom(offer)
            reply = self._exchange(msg, None, None)
            if reply.step_channel and listener is not None:
                try:
                    self.step_channel = listener.accept(offer.token, self.timeout)
                except (OSError, ValueError) as e:  # the service said it connected: the stream is not to be trusted
                    slots.close()
                    raise SamplerUnavailableError(f"the sampler at {self.address} failed: step channel: {e}") from None
        finally:
            slots.unlink()  # both ends have it open (or the service declined): nothing else may open it
            if listener is not None:
                listener.close()
        if reply.logits_form != slots.form:
            logger.info("the sampler at %s cannot share this host's memory: logits go as bytes", self.address)
            slots.close()
            return None
        kernels = try_load() if reply.greedy_steps and self.step_channel is not None else None
        if kernels is not None:
            self._greedy_views = (kernels, *slots.host_views())
        name = sampler_pb2.LogitsForm.Name(reply.logits_form)
        how = "steps over the step channel" if self.step_channel is not None else "steps over the stream"
        logger.info("the sampler at %s reads the logits in place (%s), %s", self.address, name, how)
        return slots

    def _fast_step_rows(self, requests, logits, prompt_chunks, grammar, drafts, trace_headers) -> bytes | None:
        """The step can go outside the interpreters: b"" when every row takes its raw logits' argmax (a greedy step),
        the rows' packed settings when every row samples plainly (a sampled step), None when it goes the long way.
        Such rows need nothing of their requests on the service, so a request it has not seen stays unsent until a
        step of the long way (with a row that needs more) sends it whole."""
        if not (
            self._greedy_views is not None
            and requests
            and not prompt_chunks
            and grammar is None
            and drafts is None
            and not self._finished
            and not trace_headers
            and logits.dtype in GREEDY_DTYPES
        ):
            return None
        # The same requests as the last such step: plain_sampling (and argmax_only) stay true once true.
        if not (len(requests) == len(self._plain_rows) and all(map(operator.is_, requests, self._plain_rows))):
            if not all(map(plain_sampling, requests)):
                return None
            self._plain_rows = list(requests)
            greedy = all(map(argmax_only, requests))
            self._row_settings = None if greedy else [_plain_row(r.sampling_params) for r in requests]
        if self._row_settings is None:
            return b""
        return b"".join(s + _INDEX.pack(len(r.output_token_ids)) for s, r in zip(self._row_settings, requests))

    @property
    def greedy_steps(self) -> bool:
        return self._greedy_views is not None

    def _fast_step(self, logits: torch.Tensor, rows: bytes, while_waiting) -> torch.Tensor | None:
        """The rows' tokens from a greedy step (rows empty) or a sampled one; None (the step goes the long way) when
        no slot is free or fits."""
        claimed = self.slots.claim(logits.numel() * logits.element_size())
        if claimed is None:
            return None
        slot, generation = claimed
        self._step_id += 1
        kernels, headers, data = self._greedy_views
        fd, deadline = self.step_channel.sock.fileno(), time.monotonic() + self.timeout
        args = (fd, headers, data, slot, generation, logits.contiguous(), self._step_id)
        sent = kernels.send_sampled_step(*args, rows) if rows else kernels.send_greedy_step(*args)
        if not sent:
            self._channel_closed(deadline)
        if while_waiting is not None:
            while_waiting()
        tokens, status = kernels.recv_greedy_answer(fd, self._step_id, len(logits), deadline - time.monotonic())
        if status == 1:  # closed; 2: past the deadline; 3: not this step's answer
            self._channel_closed(deadline)
        if status == 2:
            raise SamplerUnavailableError(f"the sampler at {self.address} did not answer within {self.timeout:g} s")
        if status == 3:
            raise SamplerUnavailableError(
                f"the sampler at {self.address} answered step {self._step_id} with another step's answer, "
                f"or not with {len(logits)} tokens"
            )
        if not self.slots.released(slot, generation):
            raise SamplerUnavailableError(f"the sampler at {self.address} answered before releasing slot {slot}")
        if rows:
            self.num_sampled_steps += 1
        else:
            self.num_greedy_steps += 1
        return tokens

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

    def _prompt_message(self, pieces, trace_headers) -> tuple[sampler_pb2.SampleStep, torch.Tensor | None]:
        self._step_id += 1
        msg = sampler_pb2.SampleStep(step_id=self._step_id, finished_request_ids=self._finished)
        if trace_headers:
            msg.trace_context.update(trace_headers)
        self._finished = []
        if pieces:
            msg.prompt_num_logprobs.extend(k for _, _, k, _ in pieces)
            msg.prompt_num_targets.extend(len(t) for _, _, _, t in pieces)
            msg.prompt_target_ids.extend(torch.cat([t for _, _, _, t in pieces]).tolist())
            return msg, torch.cat([lg for _, lg, _, _ in pieces])
        return msg, None

    def _add_rows(self, msg: sampler_pb2.SampleStep, requests: list) -> None:
        """Each row's request id and output tokens since its last step (with its parameters the first time); from
        here on the service is taken to have them (a step that fails resets the stream, and with it all this)."""
        for request in requests:
            request_id, output = request.request_id, request.output_token_ids
            sent = self._sent.get(request_id)
            if sent is None:
                msg.new_requests.append(new_request_to_proto(request))
                sent = 0
                p = request.sampling_params
                if p.seed is not None and not p.greedy:
                    self._seeded.add(request_id)
            msg.request_ids.append(request_id)
            msg.num_new_tokens.append(len(output) - sent)
            msg.new_token_ids.extend(output[sent:])
            self._sent[request_id] = len(output)

    def _exchange(
        self, msg: sampler_pb2.SampleStep, prompt_logits, logits, while_waiting=None
    ) -> sampler_pb2.SampleResult:
        if self.step_channel is not None:
            reply = self._exchange_on_channel(msg, prompt_logits, logits, while_waiting)
        else:
            self._stream.outbox.put((msg, logits, prompt_logits))
            if while_waiting is not None:
                while_waiting()
            reply = self._stream_reply(self.timeout)
        num_rows = len(reply.num_sampled_tokens) if msg.num_draft_tokens else len(reply.sampled_token_ids)
        got = (reply.step_id, num_rows, len(reply.prompt_logprobs))
        expected = (msg.step_id, len(msg.request_ids), len(msg.prompt_num_targets))
        if got != expected:
            raise SamplerUnavailableError(
                f"the sampler at {self.address} answered (step, tokens, prompt chunks) {got}; expected {expected}"
            )
        return reply

    def _stream_reply(self, timeout: float) -> sampler_pb2.SampleResult:
        """The stream's next reply; SamplerUnavailableError for its end (the status it ended with) or none in time."""
        try:
            reply = self._stream.replies.get(timeout=timeout)
        except queue.Empty:
            raise SamplerUnavailableError(
                f"the sampler at {self.address} did not answer within {timeout:g} s"
            ) from None
        if isinstance(reply, grpc.RpcError):
            raise SamplerUnavailableError(
                f"the sampler at {self.address} failed: {reply.code().name}: {reply.details()}"
            )
        if isinstance(reply, Exception):
            raise SamplerUnavailableError(f"the sampler at {self.address} failed: {reply}")
        return reply

    def _exchange_on_channel(self, msg, prompt_logits, logits, while_waiting) -> sampler_pb2.SampleResult:
        deadline = time.monotonic() + self.timeout
        try:
            self.step_channel.send(_serialize((msg, logits, prompt_logits)), self.timeout)
            if while_waiting is not None:
                while_waiting()
            data = self.step_channel.recv(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise SamplerUnavailableError(
                f"the sampler at {self.address} did not answer within {self.timeout:g} s"
            ) from None
        except (ChannelClosedError, OSError):
            self._channel_closed(deadline)
        try:
            return sampler_pb2.SampleResult.FromString(data)
        except DecodeError as e:
            raise SamplerUnavailableError(f"the sampler at {self.address} answered what does not decode: {e}") from None

    def _channel_closed(self, deadline: float):
        """The service went, or ended the stream (a message it refused): raise what the stream's status says."""
        self._stream_reply(max(0.0, deadline - time.monotonic()))
        raise SamplerUnavailableError(f"the sampler at {self.address} closed the step channel") from None


def _plain_row(p) -> bytes:
    """A request's PLAIN_ROW settings, without its token's index."""
    flags = (
        (GREEDY if p.greedy else 0)
        | (SEEDED if p.seed is not None else 0)
        | (TEMPERATURE if p.temperature != 1.0 else 0)
        | (TOP_P if p.top_p < 1.0 else 0)
        | (MIN_P if p.min_p > 0 else 0)
    )
    top_k = max(-1, min(p.top_k, 2**31 - 1))  # off either way past the vocabulary
    return PLAIN_ROW.pack(p.temperature, p.top_p, p.min_p, top_k, (p.seed or 0) & MASK64, flags)


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
