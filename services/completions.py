"""The gateway's assembly of one request's completions: each engine step is sent to the shared detokenizer stream
at once, and the detokenizer's answers, which come back in order, are merged with the steps they answer into the
client's chunks, one per engine step, and at the end into its Complete message. The completions, stop strings and
timings are the engine library's RequestState, the same lifecycle the offline LLM and the engine service use. A
stop-string hit in one of n > 1 completions aborts just its engine request.
"""

import asyncio
import collections
import contextlib
import time
import uuid

from engine.output_processor import RequestOutputKind, RequestState
from engine.text.detokenizer import MAX_PROMPT_CONTEXT
from llmmesh.v1 import common_pb2, detokenizer_pb2, engine_pb2, gateway_pb2
from services.engine_call import ENGINE_DONE, EngineCall, engine_request
from services.errors import invalid, unavailable
from services.telemetry import SpanKind, inject

DETOKENIZE_TIMEOUT = 10.0  # s to wait for the detokenizer's answer to a step already sent
ENGINE_END_TIMEOUT = 1.0  # s to wait for the engine's stream to end once its last message is in


def fill_decoded_tokens(positions, texts) -> None:
    """Set decoded_token on each entry, in order, from the detokenizer's token_texts."""
    texts = iter(texts)
    for position in positions:
        for entry in position.entries:
            entry.decoded_token = next(texts, "")


class GatewayRequest:
    """One Generate or Chat call from its engine call to its Complete message: the state it owns.

    That is the engine library's RequestState (its n completions, stop strings, timings), the engine call
    (services/engine_call.py), and per completion the steps sent to the shared detokenizer stream that await its
    answer. The engine call's reader passes every engine step on to the detokenizer at once; the answers come back
    in order on `results` and are merged with the steps they answer into the client's deltas.
    """

    def __init__(
        self,
        gateway,
        request,
        request_id: str,
        params,
        prompt_ids: list[int],
        arrival: float,
        span=None,
        lora_name: str = "",
        mm_inputs=(),
    ):
        self.deps, self.telemetry, self.span = gateway.deps, gateway.telemetry, span
        self.request, self.prompt_ids = request, prompt_ids
        # Unique at the engine even when clients reuse ids, and no longer than the engine takes.
        max_chars = gateway.limits.max_id_chars
        engine_request_id = request_id
        if request.request_id:
            engine_request_id = f"{request_id[: max_chars - 9]}-{uuid.uuid4().hex[:8]}"
        self.state = RequestState(engine_request_id, None, prompt_ids, params, arrival, RequestOutputKind.DELTA)
        # Ids on the shared detokenizer stream: unique there, and short whatever the client's id.
        stream_key = uuid.uuid4().hex
        self.detok_ids = [f"{stream_key}/{c.index}" for c in self.state.completions]
        self.started = [False] * len(self.detok_ids)  # whether a completion's detokenizer start was sent
        # Per completion, what was sent to the detokenizer and awaits its answer: None for the start, then
        # (engine delta, prompt logprobs) per step.
        self.pending = {detok_id: collections.deque() for detok_id in self.detok_ids}
        self.results: asyncio.Queue = asyncio.Queue()  # detokenizer answers, then ENGINE_DONE or an exception
        self.engine_done = False
        self.queue_time: float | None = None  # the engine's, sent with the first tokens
        self.engine_final = None  # the engine's last message: usage, and its own prefill and decode times
        self.stop_aborts: list[asyncio.Task] = []  # the engine told of each stop string, as they are found
        self.prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        self.detokenizer = self.detokenize_start = self.detokenize_span = None
        self.engine = EngineCall(
            self.deps,
            self.telemetry,
            span,
            request_id,
            engine_request(request, engine_request_id, prompt_ids, lora_name, mm_inputs),
            prompt_ids,
            self.results,
            lambda msg: self.detokenizer.send(self._detokenize_items(msg)),
            is_finished=lambda index: self.state.completions[index].finished,
            migration_limit=gateway.migration_limit,
            counters=gateway.counters,
        )

    def start(self, context) -> None:
        """Route the detokenizer's answers here, then start the engine call. close() undoes as much of this as was
        done."""
        self.detokenizer = self.deps.detokenizer_stream()
        self.detokenizer.open(self.detok_ids, self.results)
        # The detokenizer call's client span (None when not traced): the stream is shared, so this request's
        # context rides on its start item.
        self.detokenize_span = self.telemetry.start_span(
            "llmmesh.v1.Detokenizer/Detokenize", self.span, SpanKind.CLIENT
        )
        self.detokenize_start = self._detokenize_start()
        self.detokenize_start.trace_context.update(inject(self.detokenize_span))
        self.engine.start(context)

    def _detokenize_start(self) -> detokenizer_pb2.DetokenizeStart:
        sp = self.request.sampling_params
        # The detokenizer reads only the prompt's tail (truncate_prompt_tokens keeps the tail too).
        start = detokenizer_pb2.DetokenizeStart(
            prompt_token_ids=self.prompt_ids[-MAX_PROMPT_CONTEXT:],
            stop=sp.stop,
            include_stop_str_in_output=sp.include_stop_str_in_output,
            min_tokens=sp.min_tokens,
        )
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if sp.HasField(name):
                setattr(start, name, getattr(sp, name))
        return start

    def _detokenize_items(self, msg: engine_pb2.EngineGenerateResponse) -> list[detokenizer_pb2.DetokenizeItem]:
        """One engine message -> a detokenizer item per completion that moved (after its start, the first time);
        each step waits in `pending` for its answer."""
        items = []
        prompt_positions = list(msg.prompt_logprobs)
        n = len(self.detok_ids)
        for d in msg.outputs:
            if not 0 <= d.index < n:
                raise unavailable(f"the engine at {self.engine.address} sent completion index {d.index} of {n}")
            detok_id = self.detok_ids[d.index]
            if self.state.completions[d.index].finished:
                continue  # a stop string ended it; the engine abort is on its way
            if not self.started[d.index]:
                items.append(detokenizer_pb2.DetokenizeItem(request_id=detok_id, start=self.detokenize_start))
                self.pending[detok_id].append(None)
                self.started[d.index] = True
            positions = [*d.logprobs, *prompt_positions]
            items.append(
                detokenizer_pb2.DetokenizeItem(
                    request_id=detok_id,
                    step=detokenizer_pb2.DetokenizeStep(
                        token_ids=d.token_ids,
                        finished=bool(d.finish_reason),
                        stop_terminated=d.finish_reason == "stop" and d.WhichOneof("stop_reason") != "stop_str",
                        text_of_token_ids=[e.token_id for p in positions for e in p.entries],
                    ),
                )
            )
            self.pending[detok_id].append((d, prompt_positions))
            prompt_positions = []  # their texts ride on the first step of the message
        if msg.HasField("timings") and self.queue_time is None:
            self.queue_time = msg.timings.queue_time
        if msg.HasField("usage"):
            self.engine_final = msg
        return items

    @property
    def awaiting_answers(self) -> bool:
        return any(self.pending.values())

    async def deltas(self):
        """The client's deltas, a list per batch of detokenizer answers, until every completion finished or the
        engine's stream ended and every answer is in. An exception from the reader ends the request."""
        while not self.state.finished and not (self.engine_done and not self.awaiting_answers):
            # The engine may take its time; the detokenizer, once it has something to answer, may not.
            timeout = DETOKENIZE_TIMEOUT if self.awaiting_answers else None
            try:
                items = [await asyncio.wait_for(self.results.get(), timeout)]
            except TimeoutError:
                raise unavailable(
                    f"the detokenizer at {self.detokenizer.address} did not answer within {DETOKENIZE_TIMEOUT:.0f} s"
                ) from None
            while not self.results.empty():
                items.append(self.results.get_nowait())
            deltas = []
            for item in items:
                if item is ENGINE_DONE:
                    self.engine_done = True
                elif isinstance(item, Exception):
                    raise item
                elif (delta := self._merge(item)) is not None:
                    deltas.append(delta)
            yield deltas

    def _merge(self, result: detokenizer_pb2.DetokenizeResult) -> gateway_pb2.ChoiceDelta | None:
        """One detokenizer answer, merged with the engine step it answers; the completion's delta for the client."""
        queue = self.pending.get(result.request_id)
        if not queue:
            return None  # a completion already closed (its stop string), or an answer to nothing sent
        sent = queue.popleft()
        if result.error:  # the detokenizer refused an item: a request it cannot decode
            raise invalid(f"detokenizer: {result.error}")
        if sent is None:
            return None  # the answer to a start
        d, prompt_positions = sent
        state, c = self.state, self.state.completions[d.index]
        if c.finished:
            return None
        fill_decoded_tokens([*d.logprobs, *prompt_positions], result.token_texts)
        self.prompt_logprobs.extend(prompt_positions)
        sampled = sum(p.entries[0].logprob for p in d.logprobs if p.entries)
        state.add_tokens(c, list(d.token_ids), list(d.logprobs), sampled)
        c.text += result.text
        if result.stop_str:
            self._stop_at_string(c, result.stop_str, engine_finished=bool(d.finish_reason))
            self.detokenizer.close(result.request_id, forget_remote=True)
            self.pending.pop(result.request_id, None)
        elif d.finish_reason:
            stop_token = d.stop_token_id if d.WhichOneof("stop_reason") == "stop_token_id" else None
            state.finish(c, d.finish_reason, stop_token if stop_token is not None else (d.stop_str or None))
        if not d.token_ids and not result.text:
            return None
        return gateway_pb2.ChoiceDelta(index=d.index, text=result.text, token_ids=d.token_ids, logprobs=d.logprobs)

    def _stop_at_string(self, c, stop_str: str, engine_finished: bool) -> None:
        abort = self.state.stop_at_string(c, stop_str, engine_finished)
        span = self.span
        if span is not None:
            span.add_event(
                "stop_string",
                {
                    "gen_ai.response.choice.index": c.index,
                    "llmmesh.stop_str": stop_str,
                    "llmmesh.engine_aborted": abort is not None,
                },
            )
        if abort is not None:
            # End this completion's engine request alone (its blocks are free next step; the others go on), as
            # finished by a stop: the engine counts it "stop", and ends its stream itself if it was the last.
            address, abort = self.engine.where(c.index, abort)  # a migrated completion runs elsewhere now
            self.stop_aborts.append(
                asyncio.get_running_loop().create_task(self._abort_engine(address, abort, stop_str))
            )

    async def _abort_engine(self, address: str, engine_request_id: str, stop_str: str) -> bool:
        """Tell the engine a stop string ended one completion's engine request (a child span of the request's)."""
        attributes = {"llmmesh.engine_request_id": engine_request_id, "llmmesh.stop_str": stop_str}
        with self.telemetry.client_call("stop_string_abort", self.span, attributes) as s:
            return await self.deps.abort(address, engine_request_id, inject(s), stop_string=True)

    async def end(self) -> None:
        """Every completion is finished, or the engine's stream ended (what it left unfinished is aborted)."""
        # Once the engine sent its last message (usage), or was told that a stop string ended the request, its
        # stream is ending by itself. Let it end rather than cancel the call, which would end the engine's side of
        # a normal request CANCELLED.
        told = self.state.finished and bool(self.stop_aborts) and all(await asyncio.gather(*self.stop_aborts))
        with contextlib.suppress(TimeoutError):
            while not self.engine_done and (self.engine_final is not None or told):
                item = await asyncio.wait_for(self.results.get(), ENGINE_END_TIMEOUT)
                self.engine_done = item is ENGINE_DONE or isinstance(item, Exception)
        for c in self.state.completions:
            if not c.finished:  # the engine stream ended without finishing it
                self.state.finish(c, "abort")

    def complete(self) -> gateway_pb2.Complete:
        stream = self.request.stream
        choices = []
        for c in self.state.completions:
            choice = gateway_pb2.Choice(index=c.index, finish_reason=c.finish_reason)
            if not stream:
                choice.text = c.text
                choice.token_ids.extend(c.token_ids)
                choice.logprobs.extend(c.logprobs or ())
            if isinstance(c.stop_reason, str):
                choice.stop_str = c.stop_reason
            elif c.stop_reason is not None:
                choice.stop_token_id = c.stop_reason
            if c.cumulative_logprob is not None:
                choice.cumulative_logprob = c.cumulative_logprob
            choices.append(choice)
        final = self.engine_final
        m = self.state.metrics
        now = time.monotonic()
        return gateway_pb2.Complete(
            choices=choices,
            usage=common_pb2.Usage(
                prompt_tokens=final.usage.prompt_tokens if final is not None else len(self.prompt_ids),
                completion_tokens=m.num_generation_tokens,
                cached_tokens=final.usage.cached_tokens if final is not None else 0,
            ),
            # Time to first token and end to end as the client sees them from the gateway; time in the engine's
            # queue, prefill and decode as the engine measured them.
            timings=common_pb2.Timings(
                queue_time=self.queue_time or 0.0,
                time_to_first_token=(m.first_token_time or now) - m.arrival_time,
                e2e_latency=now - m.arrival_time,
                prefill_time=final.timings.prefill_time if final is not None else 0.0,
                decode_time=final.timings.decode_time if final is not None else 0.0,
            ),
            prompt_logprobs=self.prompt_logprobs,
        )

    def close(self) -> None:
        """Finished, failed, cancelled by the client or past its deadline: end the engine request now."""
        self.engine.close()
        if self.detokenize_span is not None:
            self.detokenize_span.end()
        if self.detokenizer is not None:
            for c, detok_id in zip(self.state.completions, self.detok_ids):
                self.detokenizer.close(detok_id, forget_remote=not c.finished)
