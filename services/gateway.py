"""The public API, llmmesh.v1.Gateway: check, tokenize, send to an engine, detokenize, stream text back.

One request's path: check access and admission, check the request against the configured limits,
tokenize (the Tokenizer service), open a Generate stream on the least-loaded healthy engine, and pass its
steps to the shared Detokenizer stream without waiting for the answers (a reader task per request); the
answers come back in order and are merged with the tokens into the client's chunks, one per engine step.
The request's state (its n completions, stop strings, timings) is the engine library's RequestState, the
same lifecycle the offline LLM and the engine service use. A client that goes away, a passed deadline or
a stop-string hit that ends the last unfinished completion cancels the engine call, which aborts the engine
request and frees its blocks; a stop-string hit in one of n > 1 completions aborts just its engine request.
"""

import asyncio
import collections
import contextlib
import hmac
import logging
import time
import uuid

import grpc

from engine.limits import RequestLimits
from engine.output_processor import RequestOutputKind, RequestState
from engine.text.detokenizer import MAX_PROMPT_CONTEXT
from llmmesh.v1 import common_pb2, detokenizer_pb2, engine_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2
from services import config
from services.convert import sampling_params_from_llmmesh
from services.dependencies import UNARY_TIMEOUT, Dependencies
from services.errors import RequestError, dependency_error, invalid, unavailable
from services.server import Server
from services.telemetry import (CURRENT_SERVER_SPAN, SpanKind, Telemetry, genai_request_attributes, inject, set_error,
                                set_response_attributes)
from services.text_model import check_messages

logger = logging.getLogger("llmmesh.gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
DETOKENIZE_TIMEOUT = 10.0  # s to wait for the detokenizer's answer to a step already sent
ENGINE_END_TIMEOUT = 1.0  # s to wait for the engine's stream to end once its last message is in
_ENGINE_DONE = object()  # queued by the engine reader after the engine's last message


def fill_decoded_tokens(positions, texts) -> None:
    """Set decoded_token on each entry, in order, from the detokenizer's token_texts."""
    texts = iter(texts)
    for position in positions:
        for entry in position.entries:
            entry.decoded_token = next(texts, "")


class Gateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, deps: Dependencies, served_model_name: str, limits: RequestLimits,
                 max_requests_in_flight: int = 1024, api_key: str | None = None,
                 trust_request_chat_template: bool = False):
        self.deps = deps
        self.served_model_name = served_model_name
        self.limits = limits
        self.max_requests_in_flight = max_requests_in_flight
        self.api_key = api_key or None
        self.trust_request_chat_template = trust_request_chat_template
        self.num_in_flight = 0
        self.draining = False
        self.telemetry = Telemetry("gateway", None)  # off; serve() gives it the server's

    # ---- access and admission --------------------------------------------------------------------

    def _check_access(self, context) -> None:
        if self.api_key is not None:
            metadata = dict(context.invocation_metadata() or ())
            given = metadata.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be 'Bearer <api key>'")
        if self.draining:
            raise unavailable("the gateway is shutting down")

    @property
    def model(self) -> str:
        """The name clients ask for: --served-model-name, else the engines' model."""
        info = self.deps.model_info
        return self.served_model_name or (info.model if info is not None else "")

    def _check_model(self, model: str) -> None:
        if model and model != self.model:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {model[:256]!r} is not served here; the served model is {self.model!r}")

    async def _unary(self, context, call):
        try:
            self._check_access(context)
            return await call()
        except RequestError as e:
            await context.abort(e.code, e.message)

    # ---- Generate / Chat -------------------------------------------------------------------------

    async def Generate(self, request, context):
        async for response in self._serve(request, context, lambda md: self._tokenize_prompt(request, md),
                                          "text_completion"):
            yield response

    async def Chat(self, request, context):
        async for response in self._serve(request, context, lambda md: self._tokenize_chat(request, md), "chat"):
            yield response

    async def _serve(self, request, context, tokenize, operation: str):
        arrival = time.monotonic()
        # The request's root span (GenAI conventions): the server span the handler wrapper started in the
        # client's trace when it sent a traceparent, else the first span of a new trace.
        span = own_span = None
        if self.telemetry.tracer is not None:
            model = request.model or self.model
            attributes = genai_request_attributes(operation, model, request.sampling_params, request.request_id)
            span = CURRENT_SERVER_SPAN.get()
            if span is not None:
                span.update_name(f"{operation} {model}")
                span.set_attributes(attributes)
            else:
                span = own_span = self.telemetry.new_trace(f"{operation} {model}", attributes)
                CURRENT_SERVER_SPAN.set(span)  # this request's log lines carry its trace id
        try:
            self._check_access(context)
            if self.num_in_flight >= self.max_requests_in_flight:
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the gateway has {self.num_in_flight} requests in flight, its limit "
                    f"(--max-requests-in-flight={self.max_requests_in_flight}); retry later",
                )
            self.num_in_flight += 1
            try:
                self._check_model(request.model)
                try:
                    self.limits.check_id("request_id", request.request_id)
                    self.limits.check_id("cache_salt", request.cache_salt)
                except ValueError as e:
                    raise invalid(str(e)) from None
                try:
                    params = sampling_params_from_llmmesh(request.sampling_params)
                    self.limits.check_params(params)
                except ValueError as e:
                    raise invalid(f"sampling_params: {e}") from None
                with self.telemetry.client_call("llmmesh.v1.Tokenizer/Tokenize", span) as tokenize_span:
                    prompt_ids = await tokenize(inject(tokenize_span))
                if not prompt_ids:
                    raise invalid("prompt is empty: it must hold at least one token")
                async for response in self._generate(request, context, params, prompt_ids, arrival, span):
                    yield response
            finally:
                self.num_in_flight -= 1
        except RequestError as e:
            if span is not None and span.is_recording():
                set_error(span, e.code, e.message)
                logger.info("request %s failed: %s %s", request.request_id, e.code.name, e.message)
            await context.abort(e.code, e.message)
        finally:
            if own_span is not None:
                own_span.end()

    async def _tokenize_prompt(self, request, metadata=()) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            ids = request.token_ids.ids
            info = await self.deps.get_model_info()
            if len(ids) >= info.max_model_len:
                raise invalid(
                    f"token_ids: the prompt is {len(ids)} tokens long; the model takes at most {info.max_model_len - 1}"
                )
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise invalid(f"token_ids: token id {bad[0]} is out of vocabulary; token ids must be in [0, {info.vocab_size})")
            return list(ids)
        if not request.text:
            raise invalid("prompt is empty: set prompt text or token_ids")
        try:
            self.limits.check_chars("text", request.text, "max_prompt_chars")
        except ValueError as e:
            raise invalid(str(e)) from None
        return list((await self.deps.tokenize(tokenizer_pb2.TokenizeRequest(text=request.text), metadata)).token_ids)

    async def _tokenize_chat(self, request, metadata=()) -> list[int]:
        try:
            check_messages(request.messages, self.limits)
        except ValueError as e:
            raise invalid(str(e)) from None
        if request.chat_template and not self.trust_request_chat_template:
            raise invalid(
                "chat_template: a request may not bring its own chat template here (start the gateway and the "
                "tokenizer with --trust-request-chat-template to allow it); leave it empty for the model's own"
            )
        chat = tokenizer_pb2.ChatInput(messages=request.messages, chat_template=request.chat_template)
        if request.HasField("add_generation_prompt"):
            chat.add_generation_prompt = request.add_generation_prompt
        return list((await self.deps.tokenize(tokenizer_pb2.TokenizeRequest(chat=chat), metadata)).token_ids)

    async def _generate(self, request, context, params, prompt_ids: list[int], arrival: float, span=None):
        request_id = request.request_id or uuid.uuid4().hex
        # Unique at the engine even when clients reuse ids, and no longer than the engine takes.
        if request.request_id:
            engine_request_id = f"{request_id[: self.limits.max_id_chars - 9]}-{uuid.uuid4().hex[:8]}"
        else:
            engine_request_id = request_id
        state = RequestState(engine_request_id, None, prompt_ids, params, arrival, RequestOutputKind.DELTA)
        sp = request.sampling_params
        engine_params = common_pb2.SamplingParams()
        engine_params.CopyFrom(sp)
        del engine_params.stop[:]  # stop strings are the detokenizer's job
        # The detokenizer reads only the prompt's tail (truncate_prompt_tokens keeps the tail too).
        start = detokenizer_pb2.DetokenizeStart(
            prompt_token_ids=prompt_ids[-MAX_PROMPT_CONTEXT:], stop=sp.stop,
            include_stop_str_in_output=sp.include_stop_str_in_output, min_tokens=sp.min_tokens,
        )
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if sp.HasField(name):
                setattr(start, name, getattr(sp, name))

        # Ids on the shared detokenizer stream: unique there, and short whatever the client's id.
        stream_key = uuid.uuid4().hex
        detok_ids = [f"{stream_key}/{c.index}" for c in state.completions]
        # Per choice, what was sent to the detokenizer and awaits its answer: (delta, prompt logprobs) per step.
        pending = {detok_id: collections.deque() for detok_id in detok_ids}
        results: asyncio.Queue = asyncio.Queue()
        address = self.deps.pick_engine()
        detokenizer = self.deps.detokenizer_stream()
        detokenizer.open(detok_ids, results)  # from here the finally below undoes everything
        self.deps.engine_in_flight[address] += 1
        # The engine and detokenizer calls' client spans (None when not traced); the detokenizer stream is shared,
        # so this request's context rides on its start item.
        engine_span = self.telemetry.start_span("llmmesh.v1.Engine/Generate", span, SpanKind.CLIENT,
                                                attributes={"server.address": address})
        detokenize_span = self.telemetry.start_span("llmmesh.v1.Detokenizer/Detokenize", span, SpanKind.CLIENT)
        start.trace_context.update(inject(detokenize_span))
        call = self.deps.engines[address].Generate(
            engine_pb2.EngineGenerateRequest(
                request_id=engine_request_id, prompt_token_ids=prompt_ids, sampling_params=engine_params,
                priority=request.priority, cache_salt=request.cache_salt,
            ),
            timeout=context.time_remaining(),  # the client's deadline ends the engine request too
            metadata=inject(engine_span),
        )
        context.add_done_callback(lambda _: call.cancel())  # even if this generator is never resumed
        engine_info = {"usage": None, "queue_time": None}
        reader = asyncio.create_task(
            self._read_engine(call, address, state, detok_ids, start, pending, results, detokenizer, engine_info)
        )
        prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        try:
            engine_done = False
            while not state.finished and not (engine_done and not any(pending.values())):
                # The engine may take its time; the detokenizer, once it has something to answer, may not.
                timeout = DETOKENIZE_TIMEOUT if any(pending.values()) else None
                try:
                    item = await asyncio.wait_for(results.get(), timeout)
                except TimeoutError:
                    raise unavailable(f"the detokenizer at {detokenizer.address} did not answer within {DETOKENIZE_TIMEOUT:.0f} s") from None
                batch = [item]
                while not results.empty():
                    batch.append(results.get_nowait())
                deltas = []
                for item in batch:
                    if item is _ENGINE_DONE:
                        engine_done = True
                        continue
                    if isinstance(item, RequestError):
                        raise item
                    delta = self._apply(item, state, pending, detokenizer, address, prompt_logprobs, span)
                    if delta is not None:
                        deltas.append(delta)
                if request.stream and deltas:
                    yield gateway_pb2.GenerateResponse(request_id=request_id, chunk=gateway_pb2.Chunk(choices=deltas))
            # The engine sent its last message (usage): its stream is ending by itself. Let it end rather than
            # cancel the call, which would end the engine's side of a normal request CANCELLED.
            with contextlib.suppress(TimeoutError):
                while not engine_done and engine_info["usage"] is not None:
                    item = await asyncio.wait_for(results.get(), ENGINE_END_TIMEOUT)
                    engine_done = item is _ENGINE_DONE or isinstance(item, RequestError)
            for c in state.completions:
                if not c.finished:  # the engine stream ended without finishing it
                    state.finish(c, "abort")
            complete = self._complete(state, request.stream, engine_info, prompt_logprobs, len(prompt_ids))
            set_response_attributes(span, request_id, complete)
            yield gateway_pb2.GenerateResponse(request_id=request_id, complete=complete)
        finally:
            for child in (engine_span, detokenize_span):
                if child is not None:
                    child.end()
            # Finished, failed, cancelled by the client or past its deadline: end the engine request now.
            call.cancel()
            reader.cancel()
            self.deps.engine_in_flight[address] -= 1
            for c, detok_id in zip(state.completions, detok_ids):
                detokenizer.close(detok_id, forget_remote=not c.finished)

    async def _read_engine(self, call, address, state, detok_ids, start, pending, results, detokenizer, engine_info):
        """Pass every engine step to the detokenizer at once (one item per choice that moved), not waiting
        for its answers; then queue _ENGINE_DONE (or the engine's error)."""
        started = [False] * len(detok_ids)
        try:
            async for msg in call:
                items = []
                prompt_positions = list(msg.prompt_logprobs)
                for d in msg.outputs:
                    if not 0 <= d.index < len(detok_ids):
                        raise unavailable(f"the engine at {address} sent completion index {d.index} of {len(detok_ids)}")
                    detok_id = detok_ids[d.index]
                    if state.completions[d.index].finished:
                        continue  # a stop string ended it; the engine abort is on its way
                    if not started[d.index]:
                        items.append(detokenizer_pb2.DetokenizeItem(request_id=detok_id, start=start))
                        pending[detok_id].append(None)
                        started[d.index] = True
                    positions = [*d.logprobs, *prompt_positions]
                    items.append(detokenizer_pb2.DetokenizeItem(request_id=detok_id, step=detokenizer_pb2.DetokenizeStep(
                        token_ids=d.token_ids,
                        finished=bool(d.finish_reason),
                        stop_terminated=d.finish_reason == "stop" and d.WhichOneof("stop_reason") != "stop_str",
                        text_of_token_ids=[e.token_id for p in positions for e in p.entries],
                    )))
                    pending[detok_id].append((d, prompt_positions))
                    prompt_positions = []  # their texts ride on the first step of the message
                if msg.HasField("usage"):
                    engine_info["usage"] = msg.usage
                if msg.HasField("timings") and engine_info["queue_time"] is None:
                    engine_info["queue_time"] = msg.timings.queue_time
                if msg.HasField("usage"):  # the last message: the engine's own prefill and decode times
                    engine_info["prefill_time"] = msg.timings.prefill_time
                    engine_info["decode_time"] = msg.timings.decode_time
                detokenizer.send(items)
            results.put_nowait(_ENGINE_DONE)
        except grpc.aio.AioRpcError as e:
            results.put_nowait(dependency_error("engine", address, e))
        except RequestError as e:
            results.put_nowait(e)

    def _apply(self, result, state: RequestState, pending, detokenizer, address, prompt_logprobs, span=None):
        """One detokenizer answer, matched with the engine step it answers; the choice's delta for the client."""
        queue = pending.get(result.request_id)
        if not queue:
            return None  # a choice already closed (its stop string), or an answer to nothing sent
        sent = queue.popleft()
        if result.error:  # the detokenizer refused an item: a request it cannot decode
            raise invalid(f"detokenizer: {result.error}")
        if sent is None:
            return None  # the answer to a start
        d, prompt_positions = sent
        index = d.index
        c = state.completions[index]
        if c.finished:
            return None
        fill_decoded_tokens([*d.logprobs, *prompt_positions], result.token_texts)
        prompt_logprobs.extend(prompt_positions)
        sampled = sum(p.entries[0].logprob for p in d.logprobs if p.entries)
        state.add_tokens(c, list(d.token_ids), list(d.logprobs), sampled)
        c.text += result.text
        if result.stop_str:
            abort = state.stop_at_string(c, result.stop_str, engine_finished=bool(d.finish_reason))
            detokenizer.close(result.request_id, forget_remote=True)
            pending.pop(result.request_id, None)
            if span is not None:
                span.add_event("stop_string", {"gen_ai.response.choice.index": index, "llmmesh.stop_str": result.stop_str,
                                               "llmmesh.engine_aborted": abort is not None})
            if abort is not None and not state.finished:
                # End this completion's engine request alone (its blocks are free next step); the others go on.
                asyncio.get_running_loop().create_task(self._abort_engine(address, abort, span))
            elif abort is not None and span is not None:
                # The last completion: the engine call is cancelled, which aborts the engine request.
                self.telemetry.start_span("stop_string_abort", span, attributes={
                    "llmmesh.engine_request_id": abort, "llmmesh.stop_str": result.stop_str}).end()
        elif d.finish_reason:
            stop_token = d.stop_token_id if d.WhichOneof("stop_reason") == "stop_token_id" else None
            state.finish(c, d.finish_reason, stop_token if stop_token is not None else (d.stop_str or None))
        if not d.token_ids and not result.text:
            return None
        return gateway_pb2.ChoiceDelta(index=index, text=result.text, token_ids=d.token_ids, logprobs=d.logprobs)

    async def _abort_engine(self, address: str, engine_request_id: str, span) -> None:
        """Abort one completion's engine request that a stop string ended (a child span of the request's)."""
        with self.telemetry.client_call("stop_string_abort", span, {"llmmesh.engine_request_id": engine_request_id}) as s:
            await self.deps.abort(address, engine_request_id, inject(s))

    def _complete(self, state: RequestState, stream: bool, engine_info, prompt_logprobs, num_prompt_ids) -> gateway_pb2.Complete:
        choices = []
        for c in state.completions:
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
        usage = engine_info["usage"]
        m = state.metrics
        now = time.monotonic()
        return gateway_pb2.Complete(
            choices=choices,
            usage=common_pb2.Usage(
                prompt_tokens=usage.prompt_tokens if usage is not None else num_prompt_ids,
                completion_tokens=m.num_generation_tokens,
                cached_tokens=usage.cached_tokens if usage is not None else 0,
            ),
            # Time to first token and end to end as the client sees them from the gateway; time in the
            # engine's queue as the engine measured it (sent with the first tokens).
            timings=common_pb2.Timings(
                queue_time=engine_info["queue_time"] or 0.0,
                time_to_first_token=(m.first_token_time or now) - m.arrival_time,
                e2e_latency=now - m.arrival_time,
                prefill_time=engine_info.get("prefill_time") or 0.0,
                decode_time=engine_info.get("decode_time") or 0.0,
            ),
            prompt_logprobs=prompt_logprobs,
        )

    # ---- the rest of the API ---------------------------------------------------------------------

    async def ListModels(self, request, context):
        async def list_models():
            info = await self.deps.get_model_info()
            return gateway_pb2.ListModelsResponse(
                models=[gateway_pb2.ModelCard(id=self.model, max_model_len=info.max_model_len, owned_by="llmmesh")]
            )

        return await self._unary(context, list_models)

    async def Tokenize(self, request, context):
        async def tokenize():
            if request.HasField("chat") and request.chat.chat_template and not self.trust_request_chat_template:
                raise invalid("chat.chat_template: a request may not bring its own chat template here")
            return await self.deps.tokenize(request)

        return await self._unary(context, tokenize)

    async def Detokenize(self, request, context):
        async def detokenize():
            try:
                return await self.deps.tokenizer.Detokenize(request, timeout=UNARY_TIMEOUT)
            except grpc.aio.AioRpcError as e:
                raise dependency_error("tokenizer", self.deps.tokenizer_address, e) from None

        return await self._unary(context, detokenize)


# ---- the process ---------------------------------------------------------------------------------


async def serve(args) -> None:
    limits = config.limits_from_args(args)
    deps = Dependencies(args.engine, args.tokenizer, args.detokenizer)
    gateway = Gateway(deps, args.served_model_name, limits, args.max_requests_in_flight, args.api_key,
                      args.trust_request_chat_template)
    # The public port takes prompts of up to --max-prompt-chars (4 bytes a character at most) and no more.
    server = Server("gateway", [SERVICE_NAME], args, max_receive_bytes=4 * limits.max_prompt_chars + 2**20)
    gateway.telemetry = server.telemetry
    server.add(gateway_pb2_grpc.add_GatewayServicer_to_server, gateway)
    await server.start()  # from here SIGINT/SIGTERM set server.stop_requested
    monitor = asyncio.create_task(deps.monitor(server, server.stop_requested))  # announces once all are healthy
    await server.stop_requested.wait()
    # Drain: new requests get UNAVAILABLE, in-flight ones have shutdown_timeout seconds to finish.
    logger.info("shutting down (up to %.0f s for %d in-flight requests)", args.shutdown_timeout, gateway.num_in_flight)
    gateway.draining = True
    monitor.cancel()
    await server.stop(args.shutdown_timeout)
    await deps.close()


def add_gateway_args(parser) -> None:
    """The gateway's own flags (not the addresses of its dependencies)."""
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients may ask for (default: the engines' --model, as in vLLM)")
    parser.add_argument("--max-requests-in-flight", type=int, default=1024,
                        help="requests in flight past which new ones get RESOURCE_EXHAUSTED")
    parser.add_argument("--api-key", default=None, help="require metadata 'authorization: Bearer KEY'")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="pass a request's own chat template on to the tokenizer (which must trust it too)")
    config.add_limit_args(parser)


def add_subcommands(subparsers) -> None:
    p = config.service_parser(subparsers, "gateway", "run the public llmmesh.v1.Gateway service")
    p.add_argument("--engine", action="append", default=None,
                   help="an engine address HOST:PORT (repeatable; in the environment, a comma-separated list)")
    p.add_argument("--tokenizer", default=None, help="the tokenizer service's HOST:PORT")
    p.add_argument("--detokenizer", default=None, help="the detokenizer service's HOST:PORT")
    add_gateway_args(p)
    p.set_defaults(func=run)


def run(args) -> None:
    for name in ("engine", "tokenizer", "detokenizer"):
        if not getattr(args, name):
            raise ValueError(f"--{name} is required (the {name} service's HOST:PORT, or LLMMESH_{name.upper()}).")
    if args.max_requests_in_flight < 1:
        raise ValueError(f"max_requests_in_flight must be at least 1, got {args.max_requests_in_flight}.")
    config.run(serve(args), args)
