"""The public API, llmmesh.v1.Gateway: check, tokenize, send to an engine, detokenize, stream text back.

One request's path: check access and admission, check the request against the configured limits,
tokenize (the Tokenizer service), open a Generate stream on the engine the router picks (services/routing.py:
by default the one where the prompt's blocks are, weighed against its load), and pass its
steps to the shared Detokenizer stream without waiting for the answers (a reader task per request); the
answers come back in order and are merged with the tokens into the client's chunks, one per engine step.
A GatewayRequest owns one request's state from the engine call on; its completions, stop strings and timings
are the engine library's RequestState, the same lifecycle the offline LLM and the engine service use. Whatever
fails for one request ends that request alone, at once. A client that goes away, a passed deadline or
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

from engine.config.utils import add_cli_args
from engine.limits import RequestLimits
from engine.output_processor import RequestOutputKind, RequestState
from engine.processor import Processor
from engine.request import SamplingParams
from engine.text.detokenizer import MAX_PROMPT_CONTEXT
from llmmesh.v1 import common_pb2, detokenizer_pb2, engine_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2
from services import config
from services.convert import sampling_params_from_llmmesh
from services.dependencies import UNARY_TIMEOUT, Dependencies
from services.errors import RequestError, dependency_error, internal, invalid, unavailable
from services.server import Server
from services.settings import ChatTemplateConfig, GatewayConfig, GatewayFlags
from services.telemetry import (
    CURRENT_SERVER_SPAN,
    SpanKind,
    Telemetry,
    genai_request_attributes,
    inject,
    lora_attributes,
    set_error,
    set_response_attributes,
)
from services.text_model import check_messages

logger = logging.getLogger("llmmesh.gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
DETOKENIZE_TIMEOUT = 10.0  # s to wait for the detokenizer's answer to a step already sent
ENGINE_END_TIMEOUT = 1.0  # s to wait for the engine's stream to end once its last message is in
LORA_LOAD_TIMEOUT = 60.0  # s an engine may take to read a LoRA adapter from its directory
_ENGINE_DONE = object()  # queued by the engine reader after the engine's last message
# How an engine that is going away ends a call before its first message: UNAVAILABLE (stopped, unreachable), or
# CANCELLED for a call that reached its server as the server began to stop (gRPC cancels calls not yet handled).
# The gateway's own cancel raises asyncio.CancelledError instead, and the engine never answers CANCELLED itself.
ENGINE_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# An engine out of reach for now: gone, or late past the call's deadline.
ENGINE_DOWN = (*ENGINE_GONE, grpc.StatusCode.DEADLINE_EXCEEDED)
# vLLM's kv_transfer_params for disaggregated prefill: to the kv_producer, and to the kv_consumer when the producer
# answered nothing (it failed: the consumer loads what is in the kvstore and computes the rest).
REMOTE_DECODE_PARAMS = '{"do_remote_decode":true}'
REMOTE_PREFILL_PARAMS = '{"do_remote_prefill":true}'


def fill_decoded_tokens(positions, texts) -> None:
    """Set decoded_token on each entry, in order, from the detokenizer's token_texts."""
    texts = iter(texts)
    for position in positions:
        for entry in position.entries:
            entry.decoded_token = next(texts, "")


class Gateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        deps: Dependencies,
        served_model_name: str,
        limits: RequestLimits,
        max_requests_in_flight: int = 1024,
        api_key: str | None = None,
        trust_request_chat_template: bool = False,
    ):
        self.deps = deps
        self.served_model_name = served_model_name
        self.limits = limits
        self.max_requests_in_flight = max_requests_in_flight
        self.api_key = api_key or None
        self.trust_request_chat_template = trust_request_chat_template
        self.processor: Processor | None = None  # admission, once the engines' ModelInfo is in
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

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters some engine has: name -> path (vLLM lists them as models beside the base model)."""
        return {name: a.lora_path for adapters in self.deps.lora_adapters.values() for name, a in adapters.items()}

    def _check_model(self, model: str) -> str:
        """The request's model: the served model ("" returned) or a LoRA adapter's name (returned); else NOT_FOUND
        naming the models served."""
        if not model or model == self.model:
            return ""
        adapters = self.lora_adapters()
        if model not in adapters:
            served = f"the served model is {self.model!r}"
            if adapters:
                names = ", ".join(map(repr, sorted(adapters)[:32])) + (" ..." if len(adapters) > 32 else "")
                served += f", its LoRA adapters {names}"
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {model[:256]!r} is not served here; {served}")
        return model

    async def _unary(self, context, call):
        try:
            self._check_access(context)
            return await call()
        except RequestError as e:
            await context.abort(e.code, e.message)

    # ---- Generate / Chat -------------------------------------------------------------------------

    async def Generate(self, request, context):
        prompt_field = request.WhichOneof("prompt") or "text"
        async for response in self._serve(
            request, context, lambda md: self._tokenize_prompt(request, md), "text_completion", prompt_field
        ):
            yield response

    async def Chat(self, request, context):
        async for response in self._serve(
            request, context, lambda md: self._tokenize_chat(request, md), "chat", "messages"
        ):
            yield response

    async def _serve(self, request, context, tokenize, operation: str, prompt_field: str):
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        span, own_span = self._root_span(request, operation)
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
                params, lora_name = await self._admit(request)
                if span is not None and lora_name:
                    span.set_attributes(lora_attributes(lora_name))
                with self.telemetry.client_call("llmmesh.v1.Tokenizer/Tokenize", span) as tokenize_span:
                    prompt_ids = await tokenize(inject(tokenize_span))
                try:
                    prompt_ids = self.processor.process_prompt(prompt_ids, params)
                except ValueError as e:  # named as the client's field: its token_ids, or the text they come from
                    raise invalid(prompt_field + str(e).removeprefix("prompt_token_ids")) from None
                async for response in self._generate(
                    request, context, request_id, params, prompt_ids, arrival, span, lora_name
                ):
                    yield response
            finally:
                self.num_in_flight -= 1
        except Exception as e:
            if not isinstance(e, RequestError):
                logger.exception("request %s failed", request_id)
                name = request_id[: self.limits.max_id_chars]
                e = internal(f"request {name!r} failed in the gateway: {type(e).__name__}: {e}")
            if span is not None and span.is_recording():
                set_error(span, e.code, e.message)
                logger.info("request %s failed: %s %s", request_id, e.code.name, e.message)
            await context.abort(e.code, e.message)
        finally:
            if own_span is not None:
                own_span.end()

    def _root_span(self, request, operation: str):
        """The request's root span (GenAI conventions), and the span to end when the request does: the server span
        the handler wrapper started in the client's trace when it sent a traceparent, else the first span of a new
        trace (ours to end). (None, None) when not traced."""
        if self.telemetry.tracer is None:
            return None, None
        model = request.model or self.model
        attributes = genai_request_attributes(operation, model, request.sampling_params, request.request_id)
        span = CURRENT_SERVER_SPAN.get()
        if span is not None:
            span.update_name(f"{operation} {model}")
            span.set_attributes(attributes)
            return span, None
        span = self.telemetry.new_trace(f"{operation} {model}", attributes)
        CURRENT_SERVER_SPAN.set(span)  # this request's log lines carry its trace id
        return span, span

    async def _admit(self, request) -> tuple[SamplingParams, str]:
        """The request's model, ids and sampling params, checked before anything is sent anywhere, through the
        engine library's one input processor, built for the engines' model from their ModelInfo (the engine checks
        what the gateway cannot: --max-logprobs and the bad words' tokens). Returns the params and the LoRA adapter
        the model names ("" for the base model)."""
        lora_name = self._check_model(request.model)
        if self.processor is None:
            info = await self.deps.get_model_info()
            self.processor = Processor(info.vocab_size, info.max_model_len, info.eos_token_ids, self.limits)
        try:
            self.processor.check_ids(request.request_id, request.cache_salt)
        except ValueError as e:
            raise invalid(str(e)) from None
        try:
            params = sampling_params_from_llmmesh(request.sampling_params)
            self.processor.process_params(params)
        except ValueError as e:
            raise invalid(f"sampling_params.{e}") from None
        return params, lora_name

    async def _tokenize_prompt(self, request, metadata=()) -> list[int]:
        if request.WhichOneof("prompt") == "token_ids":
            return list(request.token_ids.ids)
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

    async def _generate(
        self, request, context, request_id: str, params, prompt_ids: list[int], arrival: float, span, lora_name: str
    ):
        req = GatewayRequest(self, request, request_id, params, prompt_ids, arrival, span, lora_name)
        try:
            req.start(context)
            async for deltas in req.deltas():
                if request.stream and deltas:
                    yield gateway_pb2.GenerateResponse(request_id=request_id, chunk=gateway_pb2.Chunk(choices=deltas))
            await req.end()
            complete = req.complete()
            set_response_attributes(span, request_id, complete)
            yield gateway_pb2.GenerateResponse(request_id=request_id, complete=complete)
        finally:
            req.close()

    # ---- the rest of the API ---------------------------------------------------------------------

    async def ListModels(self, request, context):
        async def list_models():
            info = await self.deps.get_model_info()
            base = gateway_pb2.ModelCard(
                id=self.model, max_model_len=info.max_model_len, owned_by="llmmesh", root=info.model
            )
            adapters = [
                gateway_pb2.ModelCard(
                    id=name, max_model_len=info.max_model_len, owned_by="llmmesh", root=path, parent=self.model
                )
                for name, path in sorted(self.lora_adapters().items())
            ]
            return gateway_pb2.ListModelsResponse(models=[base, *adapters])

        return await self._unary(context, list_models)

    async def LoadLoraAdapter(self, request, context):
        return await self._unary(context, lambda: self._on_every_engine("LoadLoraAdapter", request))

    async def UnloadLoraAdapter(self, request, context):
        return await self._unary(context, lambda: self._on_every_engine("UnloadLoraAdapter", request))

    async def _on_every_engine(self, method: str, request):
        """vLLM's load/unload_lora_adapter on every engine (prefill engines too), all or nothing: where some already
        had it (ALREADY_EXISTS) or lacked it (NOT_FOUND) and the others did it, that is done; where an engine refuses
        (an unload while the adapter runs there, say), the engines that did it are undone (the adapter loaded again
        from the path each had, or unloaded) and the first refusal is the answer, naming its engine. The adapters'
        list is read again either way."""
        stubs = {**self.deps.engines, **self.deps.prefill_engines}

        async def call(address, method, request):
            try:
                return await getattr(stubs[address], method)(request, timeout=LORA_LOAD_TIMEOUT)
            except grpc.aio.AioRpcError as e:
                return e

        def undo(address) -> tuple[str, object]:
            if method == "LoadLoraAdapter":
                return "UnloadLoraAdapter", common_pb2.UnloadLoraAdapterRequest(lora_name=request.lora_name)
            load = common_pb2.LoadLoraAdapterRequest(lora_name=request.lora_name, lora_path=paths[address])
            return "LoadLoraAdapter", load

        paths = {}  # an unload's adapter path on each engine, to load it again there if another engine refuses
        if method == "UnloadLoraAdapter":
            listed = await asyncio.gather(
                *(call(a, "ListLoraAdapters", engine_pb2.ListLoraAdaptersRequest()) for a in stubs)
            )
            for address, reply in zip(stubs, listed):
                for adapter in [] if isinstance(reply, grpc.aio.AioRpcError) else reply.adapters:
                    if adapter.lora_name == request.lora_name:
                        paths[address] = adapter.lora_path
        replies = dict(zip(stubs, await asyncio.gather(*(call(a, method, request) for a in stubs))))
        errors = {a: r for a, r in replies.items() if isinstance(r, grpc.aio.AioRpcError)}
        benign = (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND)
        refusals = {a: e for a, e in errors.items() if e.code() not in benign}
        if refusals:
            done = [a for a in replies if a not in errors and (method == "LoadLoraAdapter" or a in paths)]
            await asyncio.gather(*(call(a, *undo(a)) for a in done))
        await self.deps.read_lora_adapters()
        if refusals or len(errors) == len(replies):
            address, e = next(iter((refusals or errors).items()))
            if e.code() in ENGINE_DOWN:
                raise unavailable(f"the engine at {address} is unavailable: {e.details()}")
            raise RequestError(e.code(), f"engine {address}: {e.details()}")
        return next(r for r in replies.values() if not isinstance(r, grpc.aio.AioRpcError))

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


class GatewayRequest:
    """One Generate or Chat call from its engine call to its Complete message: the state it owns.

    That is the engine library's RequestState (its n completions, stop strings, timings), the engine call and its
    reader task, and per completion the steps sent to the shared detokenizer stream that await its answer. The
    reader passes every engine step on to the detokenizer at once; the answers come back in order on `results`
    and are merged with the steps they answer into the client's deltas.
    """

    def __init__(
        self,
        gateway: Gateway,
        request,
        request_id: str,
        params,
        prompt_ids: list[int],
        arrival: float,
        span=None,
        lora_name: str = "",
    ):
        self.deps, self.telemetry, self.span = gateway.deps, gateway.telemetry, span
        self.request, self.request_id, self.prompt_ids = request, request_id, prompt_ids
        self.lora_name = lora_name  # the LoRA adapter the request's model names; "" for the base model
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
        self.results: asyncio.Queue = asyncio.Queue()  # detokenizer answers, then _ENGINE_DONE or an exception
        self.engine_done = False
        self.queue_time: float | None = None  # the engine's, sent with the first tokens
        self.engine_final = None  # the engine's last message: usage, and its own prefill and decode times
        self.stop_aborts: list[asyncio.Task] = []  # the engine told of each stop string, as they are found
        self.prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        self.address = self.routed = self.detokenizer = self.detokenize_start = self.call = self.reader = None
        self.context = None
        self.engine_span = self.detokenize_span = None
        self.kv_transfer_params = ""  # to the engine: vLLM's kv_transfer_params (JSON) with disaggregated prefill

    def start(self, context) -> None:
        """Route the detokenizer's answers here, open the engine call on the engine the router picks, and start the
        reader. close() undoes as much of this as was done."""
        self.detokenizer = self.deps.detokenizer_stream()
        self.detokenizer.open(self.detok_ids, self.results)
        # The detokenizer call's client span (None when not traced): the stream is shared, so this request's
        # context rides on its start item.
        self.detokenize_span = self.telemetry.start_span(
            "llmmesh.v1.Detokenizer/Detokenize", self.span, SpanKind.CLIENT
        )
        self.detokenize_start = self._detokenize_start()
        self.detokenize_start.trace_context.update(inject(self.detokenize_span))
        self.context = context
        if not self.deps.prefill_engines:  # else read_engine calls it after the remote prefill
            self._call_engine()
        context.add_done_callback(lambda _: self.call is not None and self.call.cancel())  # even if never resumed
        self.reader = asyncio.create_task(self.read_engine())

    def _call_engine(self, tried: tuple[str, ...] = ()) -> None:
        """Open the Generate call (and its client span) on the engine the router picks among those not tried."""
        self.routed = self.deps.route(self.prompt_ids, self.request.cache_salt, exclude=tried, lora_name=self.lora_name)
        self.address = self.routed.address
        self.engine_span = self.telemetry.start_span(
            "llmmesh.v1.Engine/Generate", self.span, SpanKind.CLIENT, attributes={"server.address": self.address}
        )
        self.call = self.deps.engines[self.address].Generate(
            self._engine_request(),
            timeout=self.context.time_remaining(),  # the client's deadline ends the engine request too
            metadata=inject(self.engine_span),
        )

    def _call_another_engine(self, error: grpc.aio.AioRpcError, tried: tuple[str, ...]) -> None:
        """The engine went away before it sent anything (stopping, restarting, unreachable): nothing reached the
        detokenizer or the client yet, so another healthy engine takes the request from the start."""
        logger.info("engine %s: %s; sending %s to another engine", self.address, error.code().name, self.request_id)
        if self.engine_span is not None:
            set_error(self.engine_span, error.code(), error.details() or "")
            self.engine_span.end()
        self.deps.router.release(self.routed)
        self.routed = None
        # No new requests for it until its next health check. Its blocks stay in the router's index: if it
        # restarted, its KV event stream ended and took them.
        self.deps.healthy_engines.discard(self.address)
        self._call_engine(tried)

    def _engine_request(self) -> engine_pb2.EngineGenerateRequest:
        params = common_pb2.SamplingParams()
        params.CopyFrom(self.request.sampling_params)
        del params.stop[:]  # stop strings are the detokenizer's job
        return engine_pb2.EngineGenerateRequest(
            request_id=self.state.request_id,
            prompt_token_ids=self.prompt_ids,
            sampling_params=params,
            priority=self.request.priority,
            cache_salt=self.request.cache_salt,
            kv_transfer_params=self.kv_transfer_params,
            lora_name=self.lora_name,
        )

    async def _remote_prefill(self) -> None:
        """vLLM's disaggregated prefill: a kv_producer engine computes the prompt (max_tokens 1, its token dropped)
        and answers once every full prompt block is in the kvstore; then the decode engine loads them and computes
        only the rest, its first token too, so its output is what one engine gives. A prefill engine that fails
        costs the decode engine the prompt's computation, never the request."""
        self.kv_transfer_params = REMOTE_PREFILL_PARAMS
        if self.request.sampling_params.HasField("prompt_logprobs"):
            return  # every prompt position runs on the decode engine anyway
        address = self.deps.prefill_engine()
        if address is None:
            return
        params = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
        if self.request.sampling_params.HasField("truncate_prompt_tokens"):
            params.truncate_prompt_tokens = self.request.sampling_params.truncate_prompt_tokens
        request = engine_pb2.EngineGenerateRequest(
            request_id=self.state.request_id,
            prompt_token_ids=self.prompt_ids,
            sampling_params=params,
            cache_salt=self.request.cache_salt,
            kv_transfer_params=REMOTE_DECODE_PARAMS,
            lora_name=self.lora_name,
        )
        # A hung prefill engine costs at most --prefill-timeout, a dead one its health check or the failed call.
        timeout = self.deps.prefill_timeout
        remaining = self.context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        with self.telemetry.client_call("remote_prefill", self.span, {"server.address": address}) as s:
            self.call = self.deps.prefill_engines[address].Generate(request, timeout=timeout, metadata=inject(s))
            try:
                async for msg in self.call:
                    if msg.kv_transfer_params:
                        self.kv_transfer_params = msg.kv_transfer_params
            except grpc.aio.AioRpcError as e:
                if self.context.done():
                    raise
                if e.code() in ENGINE_DOWN:
                    self.deps.healthy_prefill_engines.discard(address)  # until its next health check
                logger.warning(
                    "prefill engine %s: %s (%s); the decode engine computes the prompt of %s",
                    address,
                    e.code().name,
                    e.details(),
                    self.request_id,
                )
            finally:
                self.call = None

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

    async def read_engine(self) -> None:
        """The reader task: every engine step goes to the detokenizer at once, not waiting for its answers. Then it
        queues _ENGINE_DONE, or what ended the call: the engine's status, or any exception at all, so that the
        request fails now rather than wait for its deadline. An engine that is UNAVAILABLE before its first
        message (or CANCELLED, see ENGINE_GONE) hands the request to another healthy one."""
        tried = ()
        try:
            if self.deps.prefill_engines:
                await self._remote_prefill()
                self._call_engine()
            while True:
                received = False
                try:
                    async for msg in self.call:
                        if not received:
                            received = True
                            self.deps.router.first_token(self.routed)  # its prefill is done
                        self.detokenizer.send(self._detokenize_items(msg))
                    break
                except grpc.aio.AioRpcError as e:
                    tried = (*tried, self.address)
                    if received or e.code() not in ENGINE_GONE or not self.deps.healthy_engines - {*tried}:
                        raise
                    self._call_another_engine(e, tried)
            self.results.put_nowait(_ENGINE_DONE)
        except grpc.aio.AioRpcError as e:
            self.results.put_nowait(dependency_error("engine", self.address, e))
        except Exception as e:  # noqa: BLE001 (handed to the request, which ends with it)
            self.results.put_nowait(e)

    def _detokenize_items(self, msg: engine_pb2.EngineGenerateResponse) -> list[detokenizer_pb2.DetokenizeItem]:
        """One engine message -> a detokenizer item per completion that moved (after its start, the first time);
        each step waits in `pending` for its answer."""
        items = []
        prompt_positions = list(msg.prompt_logprobs)
        n = len(self.detok_ids)
        for d in msg.outputs:
            if not 0 <= d.index < n:
                raise unavailable(f"the engine at {self.address} sent completion index {d.index} of {n}")
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
                if item is _ENGINE_DONE:
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
            self.stop_aborts.append(asyncio.get_running_loop().create_task(self._abort_engine(abort, stop_str)))

    async def _abort_engine(self, engine_request_id: str, stop_str: str) -> bool:
        """Tell the engine a stop string ended one completion's engine request (a child span of the request's)."""
        attributes = {"llmmesh.engine_request_id": engine_request_id, "llmmesh.stop_str": stop_str}
        with self.telemetry.client_call("stop_string_abort", self.span, attributes) as s:
            return await self.deps.abort(self.address, engine_request_id, inject(s), stop_string=True)

    async def end(self) -> None:
        """Every completion is finished, or the engine's stream ended (what it left unfinished is aborted)."""
        # Once the engine sent its last message (usage), or was told that a stop string ended the request, its
        # stream is ending by itself. Let it end rather than cancel the call, which would end the engine's side of
        # a normal request CANCELLED.
        told = self.state.finished and bool(self.stop_aborts) and all(await asyncio.gather(*self.stop_aborts))
        with contextlib.suppress(TimeoutError):
            while not self.engine_done and (self.engine_final is not None or told):
                item = await asyncio.wait_for(self.results.get(), ENGINE_END_TIMEOUT)
                self.engine_done = item is _ENGINE_DONE or isinstance(item, Exception)
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
        for child in (self.engine_span, self.detokenize_span):
            if child is not None:
                child.end()
        if self.call is not None:
            self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
        if self.routed is not None:
            self.deps.router.release(self.routed)
        if self.detokenizer is not None:
            for c, detok_id in zip(self.state.completions, self.detok_ids):
                self.detokenizer.close(detok_id, forget_remote=not c.finished)


# ---- the process ---------------------------------------------------------------------------------


async def serve(args) -> None:
    limits = config.limits_from_args(args)
    deps = Dependencies(
        args.engine,
        args.tokenizer,
        args.detokenizer,
        limits.max_batch,
        args.routing,
        args.prefill_engine or (),
        args.prefill_timeout,
    )
    gateway = Gateway(
        deps,
        args.served_model_name,
        limits,
        args.max_requests_in_flight,
        args.api_key,
        args.trust_request_chat_template,
    )
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
    add_cli_args(parser, GatewayConfig)
    add_cli_args(parser, ChatTemplateConfig)
    config.add_limit_args(parser)


def add_subcommands(subparsers) -> None:
    p = config.service_parser(subparsers, "gateway", "run the public llmmesh.v1.Gateway service")
    add_cli_args(p, GatewayFlags, grouped=False)
    add_gateway_args(p)
    p.set_defaults(func=run)


def run(args) -> None:
    for name in ("engine", "tokenizer", "detokenizer"):
        if not getattr(args, name):
            raise ValueError(f"--{name} is required (the {name} service's HOST:PORT, or LLMMESH_{name.upper()}).")
    if args.max_requests_in_flight < 1:
        raise ValueError(f"max_requests_in_flight must be at least 1, got {args.max_requests_in_flight}.")
    if not 0 < args.prefill_timeout <= 3600:
        raise ValueError(f"--prefill-timeout must be a number of seconds in (0, 3600], got {args.prefill_timeout}.")
    config.run(serve(args), args)
