"""OutputProcessor: engine outputs -> RequestOutputs.

It turns token ids into text (incrementally, finding stop strings), logprob tensors into
Logprob dicts, and gathers the n completions of a request. It owns no model and can sit on
either side of a wire: the offline LLM uses it in-process.
"""

import time

from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.request import EngineCoreEventType, FinishReason, Request, SamplingParams
from engine.sample.sampler import LogprobsTensors
from engine.sched.output import EngineCoreOutput
from engine.text.detokenizer import RequestDetokenizer
from engine.text.tokenizer import Tokenizer


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time=None) -> list[Request]:
    """The engine requests behind one user request: itself when n == 1, else n children `i_<id>`.

    vLLM's rule: child i of a seeded request draws with seed + i. Only the first child asks for
    prompt logprobs, so the others can share the prompt's cached blocks.
    """
    if params.n == 1:
        return [Request(request_id, prompt_token_ids, params, arrival_time=arrival_time)]
    return [
        Request(
            child_request_id(index, request_id),
            prompt_token_ids,
            params.clone(
                n=1,
                seed=None if params.seed is None else params.seed + index,
                prompt_logprobs=params.prompt_logprobs if index == 0 else None,
            ),
            arrival_time=arrival_time,
        )
        for index in range(params.n)
    ]


def logprob_dicts(tensors: LogprobsTensors, token_text) -> list[dict[int, Logprob]]:
    """One {token_id: Logprob} per row: column 0's token (with its own rank) first, then the top k."""
    result = []
    for ids, lps, rank in zip(tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()):
        entry = {ids[0]: Logprob(lps[0], rank, token_text(ids[0]))}
        for top_rank, (token_id, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            # The chosen token may also be among the top k; it keeps its first entry.
            entry.setdefault(token_id, Logprob(lp, top_rank, token_text(token_id)))
        result.append(entry)
    return result


class CompletionState:
    """One sequence the engine generates: its tokens, text, logprobs and how it ended."""

    def __init__(self, index: int, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer):
        self.index = index
        self.detokenizer = RequestDetokenizer(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.detokenizer.output_text,
            list(self.token_ids),
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )


class RequestState:
    """What the user asked for: one prompt, n completions (engine requests `i_<id>` when n > 1)."""

    def __init__(self, request_id, prompt, prompt_token_ids, params: SamplingParams, tokenizer, arrival_time):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # The first prompt token has no logprob (nothing predicts it): a lone None for a 1-token prompt.
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0
        self.engine_requests = fan_out(request_id, prompt_token_ids, params, arrival_time)
        self.completions = {
            r.request_id: CompletionState(index, prompt_token_ids, r.sampling_params, tokenizer)
            for index, r in enumerate(self.engine_requests)
        }

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions.values())

    def to_output(self) -> RequestOutput:
        outputs = sorted((c.to_output() for c in self.completions.values()), key=lambda o: o.index)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            self.finished,
            self.metrics,
            self.num_cached_tokens,
            self.prompt_logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        # engine request id -> the user request it belongs to
        self.parent_of: dict[str, RequestState] = {}

    def add_request(self, request_id, prompt, prompt_token_ids, params, arrival_time=None) -> list[Request]:
        """Track a user request; returns the engine requests to add (n of them)."""
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, self.tokenizer,
            time.monotonic() if arrival_time is None else arrival_time,
        )
        self.request_states[request_id] = state
        for engine_id in state.completions:
            self.parent_of[engine_id] = state
        return state.engine_requests

    def abort_requests(self, request_ids) -> list[str]:
        """Forget user requests; returns their engine request ids, for the engine to abort."""
        engine_ids = []
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                engine_ids.extend(state.completions)
                for engine_id in state.completions:
                    self.parent_of.pop(engine_id, None)
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Finished user requests, and engine requests a stop string ended (abort them in the engine now)."""
        finished, reqs_to_abort = [], []
        now = time.monotonic()
        for out in outputs:
            state = self.parent_of.get(out.request_id)
            if state is None:
                continue  # already finished here (a stop string) or aborted: a stale output
            completion = state.completions[out.request_id]
            self._update_metrics(state, out, now)
            if out.new_prompt_logprobs is not None:
                state.prompt_logprobs = [None] + logprob_dicts(out.new_prompt_logprobs, self.tokenizer.token_text)
            completion.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and completion.logprobs is not None:
                new = logprob_dicts(out.new_logprobs, self.tokenizer.token_text)
                completion.logprobs.extend(new)
                completion.cumulative_logprob += sum(entry[t].logprob for entry, t in zip(new, out.new_token_ids))
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            stop_string = completion.detokenizer.update(out.new_token_ids, finish_reason == FinishReason.STOP)
            if stop_string is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_string
                if not out.finished:
                    reqs_to_abort.append(out.request_id)
            if finish_reason is not None:
                completion.finish_reason, completion.stop_reason = str(finish_reason), stop_reason
                del self.parent_of[out.request_id]
                if state.finished:
                    state.metrics.finished_time = now
                    del self.request_states[state.request_id]
                    finished.append(state.to_output())
        return finished, reqs_to_abort

    @staticmethod
    def _update_metrics(state: RequestState, out: EngineCoreOutput, now: float) -> None:
        m = state.metrics
        for event in out.events:
            if event.type == EngineCoreEventType.SCHEDULED and m.first_scheduled_time is None:
                m.first_scheduled_time = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                m.num_preemptions += 1
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
