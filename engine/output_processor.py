"""The request lifecycle: one user request, its n completions, and what they have produced so far.

One implementation, used everywhere a request's outputs are gathered: the offline LLM and the engine
service (through AsyncLLM) feed it EngineCoreOutputs and detokenize in process; the gateway feeds it the
engine's messages and the detokenizer service's text. Either way the same code gathers a request's n
completions (the engine requests the Processor built), ends a completion at a stop string (the caller aborts
its engine request, and outputs still in flight for it are dropped), and keeps the request's timings.
"""

import copy
import enum
import time

from engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from engine.processor import child_request_id, fan_out
from engine.request import EngineCoreEventType, FinishReason, Request, RequestFailure, SamplingParams
from engine.text.detokenizer import RequestDetokenizer

# The KV connector's request events, as RequestMetrics.kv_transfers names them.
_KV_TRANSFERS = {
    EngineCoreEventType.KV_LOAD_STARTED: "kv_load_started",
    EngineCoreEventType.KV_LOADED: "kv_loaded",
    EngineCoreEventType.KV_STORE_STARTED: "kv_store_started",
}


def logprob_dicts(tensors, token_text) -> list[dict[int, Logprob]]:
    """LogprobsTensors -> one {token_id: Logprob} per row: column 0's token (with its own rank) first, then the top k."""
    result = []
    for ids, lps, rank in zip(tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()):
        entry = {ids[0]: Logprob(lps[0], rank, token_text(ids[0]))}
        for top_rank, (token_id, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            # The chosen token may also be among the top k; it keeps its first entry.
            entry.setdefault(token_id, Logprob(lp, top_rank, token_text(token_id)))
        result.append(entry)
    return result


class RequestOutputKind(enum.Enum):
    DELTA = 1  # every output holds what is new since the last one
    FINAL_ONLY = 2  # one output, once every completion has finished


class CompletionState:
    """One of the n completions: its tokens, text and logprobs so far, and how it ended."""

    def __init__(self, index: int, engine_request_id: str, with_logprobs: bool):
        self.index = index
        self.engine_request_id = engine_request_id
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = [] if with_logprobs else None
        self.cumulative_logprob = 0.0 if with_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer: RequestDetokenizer | None = None  # in-process text; None when text comes from elsewhere
        self._sent = (0, 0, 0, False)  # tokens, characters, logprobs and the finish already handed out as deltas

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, delta: bool) -> CompletionOutput | None:
        """Everything so far, or (delta) only what is new since the last call: None when nothing is."""
        tokens, chars, logprobs, finished = self._sent if delta else (0, 0, 0, False)
        if delta and finished:
            return None
        new = (len(self.token_ids), len(self.text), len(self.logprobs or ()), self.finished)
        if delta and new[:3] == (tokens, chars, logprobs) and not self.finished:
            return None
        self._sent = new
        return CompletionOutput(
            self.index,
            self.text[chars:],
            self.token_ids[tokens:],
            self.cumulative_logprob,
            None if self.logprobs is None else self.logprobs[logprobs:],
            self.finish_reason,
            self.stop_reason,
        )


class RequestState:
    """What the user asked for: one prompt, n completions (engine requests `i_<id>` when n > 1)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = output_kind
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        # The first prompt token has no logprob (nothing predicts it): a lone None for a 1-token prompt.
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self._prompt_logprobs_sent = 0
        self.num_cached_tokens = 0
        self.error: RequestFailure | None = None  # the request failed on its own (its outputs end "error")
        self.engine_requests: list[Request] = []  # what the engine runs (OutputProcessor.add_request sets it)
        self.pooling_output = None  # a pooling request's vector, once its prompt has run
        with_logprobs = params.logprobs is not None
        self.completions = [
            CompletionState(i, request_id if params.n == 1 else child_request_id(i, request_id), with_logprobs)
            for i in range(params.n)
        ]
        self.by_engine_id = {c.engine_request_id: c for c in self.completions}

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def unfinished_engine_ids(self) -> list[str]:
        return [c.engine_request_id for c in self.completions if not c.finished]

    def add_tokens(
        self,
        completion: CompletionState,
        token_ids: list[int],
        logprobs: list | None,
        sampled_logprob_sum: float = 0.0,
        now: float | None = None,
    ) -> None:
        """New tokens of one completion (and their logprob entries, in the caller's representation)."""
        completion.token_ids += token_ids
        if completion.logprobs is not None and logprobs is not None:
            completion.logprobs += logprobs
            completion.cumulative_logprob += sampled_logprob_sum
        if token_ids:
            m = self.metrics
            now = time.monotonic() if now is None else now
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += len(token_ids)

    def add_events(self, events) -> None:
        m = self.metrics
        for event in events:
            if event.type == EngineCoreEventType.SCHEDULED and m.first_scheduled_time is None:
                m.first_scheduled_time = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                m.num_preemptions += 1
                m.preemption_times.append(event.timestamp)
            elif event.type == EngineCoreEventType.ENCODE_STARTED:
                m.encoder_runs.append((event.timestamp, None, event.num_tokens))
            elif event.type == EngineCoreEventType.ENCODED and m.encoder_runs:
                m.encoder_runs[-1] = (m.encoder_runs[-1][0], event.timestamp, event.num_tokens)
            elif event.type in _KV_TRANSFERS:
                m.kv_transfers.append((event.timestamp, _KV_TRANSFERS[event.type], event.num_tokens))

    def add_prompt_logprobs(self, positions: list) -> None:
        if self.prompt_logprobs is not None:
            self.prompt_logprobs += positions

    def finish(self, completion: CompletionState, finish_reason, stop_reason=None, now: float | None = None) -> None:
        completion.finish_reason, completion.stop_reason = str(finish_reason), stop_reason
        if self.finished:
            self.metrics.finished_time = time.monotonic() if now is None else now

    def fail(self, failure: RequestFailure, now: float | None = None) -> list[str]:
        """The request failed: every unfinished completion ends "error". Returns their engine request ids."""
        self.error = self.error or failure
        unfinished = self.unfinished_engine_ids()
        for c in self.completions:
            if not c.finished:
                self.finish(c, FinishReason.ERROR, now=now)
        return unfinished

    def stop_at_string(self, completion: CompletionState, stop_str: str, engine_finished: bool) -> str | None:
        """A stop string ended this completion. Returns its engine request id when the engine is still running
        it (the caller aborts it, so its blocks are free before the next step), else None."""
        self.finish(completion, FinishReason.STOP, stop_str)
        return None if engine_finished else completion.engine_request_id

    def output(self) -> RequestOutput | None:
        """What to hand out now: in DELTA mode whatever is new, in FINAL_ONLY mode everything once finished."""
        delta = self.output_kind == RequestOutputKind.DELTA
        if not delta and not self.finished:
            return None
        if self.pooling_output is not None and self.error is None:
            return PoolingRequestOutput(
                self.request_id,
                PoolingOutput(self.pooling_output),
                self.prompt_token_ids,
                self.finished,
                self.metrics,
                self.num_cached_tokens,
            )
        prompt_logprobs = self.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs, self._prompt_logprobs_sent = (
                prompt_logprobs[self._prompt_logprobs_sent :],
                len(prompt_logprobs),
            )
        outputs = [o for o in (c.output(delta) for c in self.completions) if o is not None]
        if delta and not outputs and not prompt_logprobs:
            return None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            self.finished,
            copy.copy(self.metrics),  # as of this output: the live one moves on while a consumer holds it
            self.num_cached_tokens,
            prompt_logprobs,
            self.error,
        )


class OutputProcessor:
    """EngineCoreOutputs -> RequestOutputs, detokenizing in process (vLLM's OutputProcessor)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: no text (requests with detokenize=False only)
        self.request_states: dict[str, RequestState] = {}
        self.parent_of: dict[str, RequestState] = {}  # engine request id -> its user request

    def add_request(
        self,
        request_id,
        prompt,
        prompt_token_ids,
        params: SamplingParams,
        arrival_time=None,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        engine_requests: list[Request] | None = None,
    ) -> RequestState:
        """Track a user request and the n engine requests behind it: those Processor.process_inputs built, or
        (None) plain ones, for a caller that drives the engine by hand."""
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")
        state = RequestState(request_id, prompt, prompt_token_ids, params, arrival_time, output_kind)
        if engine_requests is None:
            engine_requests = fan_out(request_id, prompt_token_ids, params, state.metrics.arrival_time)
        state.engine_requests = engine_requests
        taken = [c.engine_request_id for c in state.completions if c.engine_request_id in self.parent_of]
        if taken:
            raise ValueError(f"request_id {request_id!r} clashes with the running engine request {taken[0]!r}.")
        if params.detokenize:
            if self.tokenizer is None:
                raise ValueError("detokenize needs the engine's tokenizer, which is not loaded.")
            for c, r in zip(state.completions, state.engine_requests):
                c.detokenizer = RequestDetokenizer(self.tokenizer, prompt_token_ids, r.sampling_params)
        self.request_states[request_id] = state
        for c in state.completions:
            self.parent_of[c.engine_request_id] = state
        return state

    def abort_requests(self, request_ids) -> list[str]:
        """Forget user requests; returns their unfinished engine request ids, for the engine to abort."""
        engine_ids = []
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                for c in state.completions:
                    if self.parent_of.pop(c.engine_request_id, None) is not None:
                        engine_ids.append(c.engine_request_id)
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs, now: float | None = None) -> tuple[list[RequestOutput], list[str]]:
        """One step's outputs -> the RequestOutputs to hand out now (one per request that has something), and
        the engine requests a stop string ended (abort them in the engine now)."""
        touched: dict[str, RequestState] = {}
        reqs_to_abort = []
        now = time.monotonic() if now is None else now
        for out in outputs:
            state = self.parent_of.get(out.request_id)
            if state is None:
                continue  # already finished here (a stop string) or aborted: a stale output
            touched[state.request_id] = state
            try:
                failure = out.failure
                if failure is None:
                    abort = self._process_output(state, state.by_engine_id[out.request_id], out, now)
                    if abort is not None:
                        reqs_to_abort.append(abort)
            except Exception as e:  # noqa: BLE001 (detokenizing or stop strings failed for this request: it alone ends)
                failure = RequestFailure.from_exception(state.request_id, "output processing", e)
            if failure is not None:
                reqs_to_abort += [i for i in state.fail(failure, now) if i != out.request_id or not out.finished]
                for c in state.completions:
                    self.parent_of.pop(c.engine_request_id, None)
            elif state.by_engine_id[out.request_id].finished:
                del self.parent_of[out.request_id]
        results = []
        for state in touched.values():
            if state.finished:
                del self.request_states[state.request_id]
            output = state.output()
            if output is not None:
                results.append(output)
        return results, reqs_to_abort

    def _process_output(self, state: RequestState, completion: CompletionState, out, now: float) -> str | None:
        """One engine request's step: tokens, logprobs, text, stop strings. Returns its engine request id when a
        stop string ended it while the engine still runs it (to abort there), else None."""
        state.add_events(out.events)
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.pooling_output is not None:
            state.pooling_output = out.pooling_output
        token_text = self.tokenizer.token_text if completion.detokenizer is not None else _no_text
        if out.new_prompt_logprobs is not None:
            state.add_prompt_logprobs(logprob_dicts(out.new_prompt_logprobs, token_text))
        logprobs = None
        if out.new_logprobs is not None:
            logprobs = logprob_dicts(out.new_logprobs, token_text)
        sampled = sum(entry[t].logprob for entry, t in zip(logprobs or (), out.new_token_ids))
        state.add_tokens(completion, out.new_token_ids, logprobs, sampled, now)
        stop_str = None
        if completion.detokenizer is not None:
            stop_str = completion.detokenizer.update(out.new_token_ids, out.finish_reason == FinishReason.STOP)
            ended = out.finished or stop_str is not None
            completion.text += completion.detokenizer.get_next_output_text(ended, delta=True)
        if stop_str is not None:
            return state.stop_at_string(completion, stop_str, out.finished)
        if out.finished:
            state.finish(completion, out.finish_reason, out.stop_reason, now)
        return None


def _no_text(token_id: int) -> None:
    return None
