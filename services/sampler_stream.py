"""One engine's Sample stream in the sampler service: its requests' sampling state, kept across steps, and each
step sampled with the library's SamplingMetadata.from_requests and Sampler on the same rows in the same order as
the engine would, so outputs are identical. A step's message is checked whole before any state changes; a
ValueError names the bad field."""

import functools
import itertools
import logging
from dataclasses import dataclass, field

import torch

from engine.request import RequestFailure, SamplingParams
from engine.sample.metadata import MetadataCache, SamplingMetadata
from engine.sample.ops import seeded_generators
from engine.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, expand_positions
from engine.sample.sampler import LogprobsTensors, Sampler, compute_logprobs, gather_logprobs
from kernels.cpu_ops import try_load
from llmmesh.v1 import sampler_pb2
from mesh.sampler.channel import StepChannel, connect
from mesh.sampler.slots import SharedSlots
from mesh.sampler.wire import (
    LOGITS_DTYPES,
    check_wire_token_ids,
    drafts_from_proto,
    dtype_and_shape_from_proto,
    grammar_bitmask_from_proto,
    logprobs_tensors_to_proto,
    sampler_params_from_proto,
    tensor_from_proto,
)

logger = logging.getLogger("llmmesh.sampler")
_FAILED_ROW = SamplingParams(temperature=0.0)  # what a refused request's row samples with (its token is dropped)


@dataclass
class SamplingState:
    """What SamplingMetadata.from_requests reads of a request, kept across steps."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)
    generators: list[torch.Generator] = field(default_factory=list)  # seeded: one per row it has in a step
    failure: RequestFailure | None = None  # its parameters were refused: its row fails, the others go on


class StreamLimitError(ValueError):
    """A step would have the stream keep more requests' state than --max-requests-per-stream, or more of their tokens
    than --max-tokens-per-stream."""


def _num_tokens(state: SamplingState) -> int:
    return len(state.prompt_token_ids) + len(state.output_token_ids)


class StreamState:
    """One engine's stream: its requests' states (max_requests at most, holding max_tokens prompt and output tokens
    at most), and the step it is at."""

    def __init__(self, device: torch.device, max_requests: int = 65536, max_tokens: int = 2**25):
        self.device = device
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests: dict[str, SamplingState] = {}
        self.num_tokens = 0  # prompt and output tokens of the requests kept
        self.sampler = Sampler(parallel_argmax=False)
        self.metadata = MetadataCache()
        self.num_steps = 0
        self.slots: SharedSlots | None = None  # the engine's shared-memory slots, when this stream took them
        self.step_channel: StepChannel | None = None  # the engine's step channel, when this stream connected to it
        # Answers the channel's greedy steps until another frame comes: when the slots are this host's memory and
        # the CPU kernels load.
        self.serve_greedy_steps = None

    def step(self, msg: sampler_pb2.SampleStep) -> sampler_pb2.SampleResult:
        """Check the whole message before changing any state; ValueError names the bad field. (Not under
        inference_mode: nothing here requires grad, and entering it costs time every step.)"""
        self.num_steps += 1
        if msg.HasField("shared_memory"):
            if self.num_steps > 1:
                raise ValueError("shared_memory: offered only in a stream's first message")
            form = self._take_offer(msg.shared_memory)
        result = self._step(msg)
        if msg.HasField("shared_memory"):
            result.logits_form = form
            result.step_channel = self.step_channel is not None
            result.greedy_steps = self.serve_greedy_steps is not None
        if msg.HasField("shared_logits"):  # read to the end (the results are on the host): the slot is the engine's
            self.slots.finish(msg.shared_logits.slot, msg.shared_logits.generation)
        return result

    def _take_offer(self, offer: sampler_pb2.SharedMemoryOffer) -> int:
        """The LogitsForm this stream's logits take: in the engine's slots when they can be mapped here."""
        try:
            self.slots = SharedSlots.from_offer(offer, self.device)
        except (OSError, ValueError, RuntimeError) as e:  # another host, user or GPU, or no CUDA IPC: bytes
            logger.info("an engine's shared memory cannot be used here (%s): its logits come as bytes", e)
            return sampler_pb2.LOGITS_FORM_BYTES
        if offer.step_socket:
            try:
                self.step_channel = connect(offer.step_socket, offer.token)
            except (OSError, ValueError) as e:
                logger.info("an engine's step channel cannot be used here (%s): its steps come on the stream", e)
        kernels = try_load() if self.device.type == "cpu" and self.slots.device_ring is None else None
        if self.step_channel is not None and kernels is not None:
            fd = self.step_channel.sock.fileno()
            self.serve_greedy_steps = functools.partial(kernels.serve_greedy_steps, fd, *self.slots.host_views())
        return self.slots.form

    def _step(self, msg: sampler_pb2.SampleStep) -> sampler_pb2.SampleResult:
        rows, logits, news, prompt_logits, drafts = self._check(msg)
        num_rows = len(msg.request_ids) + (len(msg.draft_token_ids) if drafts else 0)
        grammar = grammar_bitmask_from_proto(msg, num_rows, 0 if logits is None else logits.shape[1])
        for request_id in msg.finished_request_ids:
            if (state := self.requests.pop(request_id, None)) is not None:
                self.num_tokens -= _num_tokens(state)
        for new in news:
            self.requests[new.request_id] = new
            self.num_tokens += len(new.prompt_token_ids)
        self.num_tokens += len(msg.new_token_ids)  # each goes to a row's output below
        result = sampler_pb2.SampleResult(step_id=msg.step_id)
        result.prompt_logprobs.extend(logprobs_tensors_to_proto(lp) for lp in self._prompt_logprobs(msg, prompt_logits))
        if not rows:
            return result
        start = 0
        for request_id, n in zip(msg.request_ids, msg.num_new_tokens):
            rows[request_id].output_token_ids.extend(msg.new_token_ids[start : start + n])
            start += n
        states = [rows[request_id] for request_id in msg.request_ids]
        # With drafts, a request's rows are its verified positions (the rejection sampler's views of it).
        positions = states if drafts is None else expand_positions(states, drafts)
        generators = seeded_generators(positions, {s.request_id: s.generators for s in states}, self.device)
        first_rows = itertools.accumulate(drafts.num_positions, initial=0) if drafts else range(len(states))
        failed = {row: s.failure for row, s in zip(first_rows, states) if s.failure is not None}
        if not failed:  # a failed row's failure is added to the metadata, which then is this step's alone
            metadata = self.metadata.get(positions, generators, logits.shape[-1], self.device, grammar)
        else:
            metadata = SamplingMetadata.from_requests(positions, generators, logits.shape[-1], self.device, grammar)
            metadata.failed.update(failed)
        output = self.sampler(logits, metadata, drafts)
        if drafts is None:
            result.sampled_token_ids.extend(output.sampled_token_ids.tolist())
        else:
            for tokens in output.sampled_token_ids.tolist():
                tokens = [t for t in tokens if t != PLACEHOLDER_TOKEN_ID]
                result.sampled_token_ids.extend(tokens)
                result.num_sampled_tokens.append(len(tokens))
        for row, failure in output.failed.items():
            result.failed.add(row=row, message=failure.message, invalid_input=failure.invalid_input)
        if output.logprobs is not None:
            result.logprobs.CopyFrom(logprobs_tensors_to_proto(output.logprobs))
        return result

    def _check(self, msg: sampler_pb2.SampleStep):
        """The rows' states by request id (new ones not yet registered), the logits, the new states and the
        prompt logits."""
        n = len(msg.request_ids)
        logits, vocab, field = None, None, "logits"
        if msg.HasField("shared_logits"):
            logits, field = self._shared_logits(msg), "shared_logits"
        elif n or msg.HasField("logits"):
            logits = tensor_from_proto(msg.logits, "logits", LOGITS_DTYPES, 2, self.device)
        drafts = None
        if logits is not None:
            vocab = logits.shape[1]
            drafts = drafts_from_proto(msg, vocab, self.device)
            num_rows = n + (len(msg.draft_token_ids) if drafts else 0)
            if logits.shape[0] != num_rows or vocab == 0:
                raise ValueError(
                    f"{field}.shape must be [{num_rows} rows (one per request_ids, and one per draft_token_ids), "
                    f"vocab], got {list(logits.shape)}"
                )
        if len(msg.num_new_tokens) != n:
            raise ValueError(f"num_new_tokens must have one entry per request_ids ({n}), got {len(msg.num_new_tokens)}")
        if any(k < 0 for k in msg.num_new_tokens) or sum(msg.num_new_tokens) != len(msg.new_token_ids):
            raise ValueError(
                f"new_token_ids holds {len(msg.new_token_ids)} tokens; num_new_tokens adds up to "
                f"{sum(msg.num_new_tokens)} (each must be >= 0)"
            )
        if vocab is not None:
            check_wire_token_ids(msg.new_token_ids, vocab, "new_token_ids")
        forgotten = set(msg.finished_request_ids)
        news = {}
        for i, new in enumerate(msg.new_requests):
            where = f"new_requests[{i}]"
            if new.request_id in news or (new.request_id in self.requests and new.request_id not in forgotten):
                raise ValueError(f"{where}.request_id {new.request_id!r} is already known on this stream")
            if vocab is None:
                raise ValueError(f"{where}: a new request needs its row in request_ids and logits")
            try:  # a request's own parameters fail its row alone, not the stream
                params = sampler_params_from_proto(new.params, vocab, f"{where}.params")
                check_wire_token_ids(new.params.eos_token_ids, vocab, f"{where}.params.eos_token_ids")
                check_wire_token_ids(new.prompt_token_ids, vocab, f"{where}.prompt_token_ids")
            except ValueError as e:
                failure = RequestFailure(f"request {new.request_id}: sampling failed: {e}", invalid_input=True)
                news[new.request_id] = SamplingState(new.request_id, _FAILED_ROW, [], (), failure=failure)
                continue
            news[new.request_id] = SamplingState(
                new.request_id, params, list(new.prompt_token_ids), tuple(new.params.eos_token_ids)
            )
        rows = {}
        for i, request_id in enumerate(msg.request_ids):
            state = news.get(request_id) or (self.requests.get(request_id) if request_id not in forgotten else None)
            if state is None:
                raise ValueError(
                    f"request_ids[{i}]: unknown request id {request_id!r} (not in new_requests, or finished)"
                )
            if request_id in rows:
                raise ValueError(f"request_ids[{i}]: request id {request_id!r} has two rows")
            rows[request_id] = state
        if set(news) - set(rows):
            raise ValueError(f"new_requests: {sorted(set(news) - set(rows))[0]!r} has no row in request_ids")
        kept = len(self.requests) - sum(r in self.requests for r in forgotten) + len(news)
        if news and kept > self.max_requests:
            raise StreamLimitError(
                f"new_requests: the stream would keep {kept} requests' sampling state, over the sampler's "
                f"--max-requests-per-stream ({self.max_requests}); finish some first"
            )
        tokens = self.num_tokens - sum(_num_tokens(self.requests[r]) for r in forgotten if r in self.requests)
        tokens += sum(len(s.prompt_token_ids) for s in news.values()) + len(msg.new_token_ids)
        if tokens > self.max_tokens:
            raise StreamLimitError(
                f"new_requests and new_token_ids: the stream would keep {tokens} prompt and output tokens, over the "
                f"sampler's --max-tokens-per-stream ({self.max_tokens}); finish some first"
            )
        return rows, logits, news.values(), self._check_prompt_chunks(msg), drafts

    def _shared_logits(self, msg: sampler_pb2.SampleStep) -> torch.Tensor:
        """The rows' logits in the engine's slot, in place (a copy only to another device than the slot's)."""
        if msg.HasField("logits"):
            raise ValueError("logits and shared_logits: a step's logits come in one of them, not both")
        if self.slots is None:
            raise ValueError("shared_logits: this stream took no shared memory (its logits come as bytes)")
        shared = msg.shared_logits
        dtype, shape = dtype_and_shape_from_proto(shared, "shared_logits", LOGITS_DTYPES, 2)
        try:
            return self.slots.read(shared.slot, shared.generation, dtype, shape).to(self.device)
        except ValueError as e:
            raise ValueError(f"shared_logits: {e}") from None

    def _check_prompt_chunks(self, msg: sampler_pb2.SampleStep) -> torch.Tensor | None:
        chunks = len(msg.prompt_num_targets)
        if len(msg.prompt_num_logprobs) != chunks:
            raise ValueError(
                f"prompt_num_logprobs must have one entry per chunk ({chunks}), got {len(msg.prompt_num_logprobs)}"
            )
        if any(t < 0 for t in msg.prompt_num_targets) or sum(msg.prompt_num_targets) != len(msg.prompt_target_ids):
            raise ValueError(
                f"prompt_target_ids holds {len(msg.prompt_target_ids)} tokens; prompt_num_targets adds "
                f"up to {sum(msg.prompt_num_targets)} (each must be >= 0)"
            )
        if chunks or msg.HasField("prompt_logits"):
            logits = tensor_from_proto(msg.prompt_logits, "prompt_logits", LOGITS_DTYPES, 2, self.device)
            vocab = logits.shape[1]
            if logits.shape[0] != len(msg.prompt_target_ids) or vocab == 0:
                raise ValueError(
                    f"prompt_logits.shape must be [{len(msg.prompt_target_ids)} rows (one per "
                    f"prompt_target_ids), vocab], got {list(logits.shape)}"
                )
            check_wire_token_ids(msg.prompt_target_ids, vocab, "prompt_target_ids")
            bad = [k for k in msg.prompt_num_logprobs if not 0 <= k <= vocab]
            if bad:
                raise ValueError(f"prompt_num_logprobs must be in [0, {vocab}], got {bad[0]}")
            return logits
        return None

    def _prompt_logprobs(self, msg: sampler_pb2.SampleStep, prompt_logits) -> list[LogprobsTensors]:
        results, start = [], 0
        for k, n in zip(msg.prompt_num_logprobs, msg.prompt_num_targets):
            targets = torch.tensor(msg.prompt_target_ids[start : start + n], dtype=torch.int64, device=self.device)
            logits = prompt_logits[start : start + n]
            results.append(gather_logprobs(compute_logprobs(logits), k, targets))
            start += n
        return results
