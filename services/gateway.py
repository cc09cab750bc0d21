"""The public API, llmmesh.v1.Gateway: check, tokenize, send to an engine, detokenize, stream text back.

One request's path: check access and admission, check the request against the configured limits,
tokenize (the Tokenizer service), open a Generate stream on the engine the router picks (services/routing.py:
by default the one where the prompt's blocks are, weighed against its load; services/engine_call.py, after the
prompt's prefill on a prefill engine with services/disaggregation.py), and pass its steps to the shared
Detokenizer stream without waiting for the answers (a reader task per request); the answers come back in order
and are merged with the tokens into the client's chunks, one per engine step (services/completions.py, where a
GatewayRequest owns one request's state from the engine call on). Whatever fails for one request ends that
request alone, at once. A client that goes away, a passed deadline or a stop-string hit that ends the last
unfinished completion cancels the engine call, which aborts the engine request and frees its blocks. The
gateway reaches its dependencies (the engines, tokenizer and detokenizer) through services/dependencies.py.
"""

import asyncio
import dataclasses
import logging
import time
import uuid

import grpc

from engine.config.utils import add_argument, add_cli_args
from engine.limits import RequestLimits
from engine.pooling.params import PoolingParams
from engine.processor import Processor
from engine.request import SamplingParams
from llmmesh.v1 import common_pb2, engine_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2
from services import config
from services.completions import GatewayRequest
from services.convert import sampling_params_from_llmmesh
from services.dependencies import Dependencies
from services.errors import RequestError, internal, invalid, unavailable
from services.server import Server, credentials
from services.settings import (
    ChatTemplateConfig,
    GatewayConfig,
    GatewayFlags,
    GatewayTLSConfig,
    ImageBytesConfig,
    WatchdogConfig,
    check_step_timeouts,
)
from services.telemetry import (
    CURRENT_SERVER_SPAN,
    Telemetry,
    genai_request_attributes,
    inject,
    lora_attributes,
    set_error,
    set_response_attributes,
)
from services.tenants import (
    Tenant,
    Tenants,
    engine_adapter_name,
    engine_adapter_path,
    load_tenants,
    refuse_key_on_command_line,
    tenant_salt,
    visible_adapters,
)
from services.text_model import check_messages

logger = logging.getLogger("llmmesh.gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def chat_fields_named(e: RequestError, own_template: bool) -> RequestError:
    """The tokenizer's refusal of a chat, in the client's ChatRequest fields: the tokenizer names its ChatInput's
    ("chat.chat_template_kwargs.x"), which ChatRequest has at its top level. A template that raises ("chat: cannot
    apply the chat template: System role not supported") refuses the messages, or is the request's own."""
    if e.code != grpc.StatusCode.INVALID_ARGUMENT:
        return e
    if e.message.startswith("chat."):
        return invalid(e.message.removeprefix("chat."))
    if e.message.startswith("chat:"):
        return invalid(("chat_template" if own_template else "messages") + e.message.removeprefix("chat"))
    return e


class Gateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        deps: Dependencies,
        served_model_name: str,
        limits: RequestLimits,
        max_requests_in_flight: int = 1024,
        tenants: Tenants | None = None,
        trust_request_chat_template: bool = False,
        migration_limit: int = 3,
    ):
        self.deps = deps
        self.migration_limit = migration_limit  # moves a request may make when its engine goes away mid-stream
        self.counters = {"request_migrations": 0}  # exported as llmmesh:<name>_total
        self.served_model_name = served_model_name
        self.limits = limits
        self.max_requests_in_flight = max_requests_in_flight
        self.tenants = tenants or Tenants()  # no keys: open access, requests of no tenant
        self.trust_request_chat_template = trust_request_chat_template
        self.processor: Processor | None = None  # admission, once the engines' ModelInfo is in
        self.num_in_flight = 0
        self.draining = False
        self.telemetry = Telemetry("gateway", None)  # off; serve() gives it the server's

    # ---- access and admission --------------------------------------------------------------------

    def _check_access(self, context) -> Tenant | None:
        """The caller's tenant (None without keys)."""
        tenant = self.tenants.authenticate(context.invocation_metadata())
        if self.draining:
            raise unavailable("the gateway is shutting down")
        return tenant

    def _check_in_flight(self, tenant: Tenant | None, context) -> None:
        """Room for one more call of any kind: under --max-requests-in-flight, and within its tenant's rate."""
        if self.num_in_flight >= self.max_requests_in_flight:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway has {self.num_in_flight} requests in flight, its limit "
                f"(--max-requests-in-flight={self.max_requests_in_flight}); retry later",
            )
        if tenant is not None:
            tenant.admit(context)

    @property
    def model(self) -> str:
        """The name clients ask for: --served-model-name, else the engines' model."""
        return self.served_model_name or self.deps.model_name()

    def _check_model(self, model: str, tenant: Tenant | None) -> str:
        """The request's model: the served model ("" returned) or a LoRA adapter's name (its name on the engines
        returned); else NOT_FOUND naming the models served (to this tenant)."""
        if not model or model == self.model:
            return ""
        adapters = visible_adapters(tenant, self.deps.lora_adapter_paths())
        if model not in adapters:
            served = f"the served model is {self.model!r}"
            if adapters:
                names = ", ".join(map(repr, sorted(adapters)[:32])) + (" ..." if len(adapters) > 32 else "")
                served += f", its LoRA adapters {names}"
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {model[:256]!r} is not served here; {served}")
        return adapters[model]

    async def _unary(self, context, call):
        """call(tenant), under the same access and limits as a generation."""
        try:
            tenant = self._check_access(context)
            self._check_in_flight(tenant, context)
            self.num_in_flight += 1
            try:
                return await call(tenant)
            finally:
                self.num_in_flight -= 1
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
            tenant = self._check_access(context)
            self._check_in_flight(tenant, context)
            self.num_in_flight += 1
            try:
                params, lora_name = await self._admit(request, tenant)
                request.cache_salt = tenant_salt(tenant, request.cache_salt)  # the engines see the tenant's salt
                if span is not None and lora_name:
                    span.set_attributes(lora_attributes(lora_name))
                with self.telemetry.client_call("llmmesh.v1.Tokenizer/Tokenize", span) as tokenize_span:
                    prompt_ids, mm_inputs = await tokenize(inject(tokenize_span))
                try:
                    prompt_ids = self.processor.process_prompt(prompt_ids, params)
                except ValueError as e:  # named as the client's field: its token_ids, or the text they come from
                    raise invalid(prompt_field + str(e).removeprefix("prompt_token_ids")) from None
                if tenant is not None:
                    tenant.take_tokens(context, len(prompt_ids))
                async for response in self._generate(
                    request, context, request_id, params, prompt_ids, arrival, span, lora_name, mm_inputs
                ):
                    if tenant is not None and response.HasField("complete"):
                        tenant.charge_tokens(response.complete.usage.completion_tokens)
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

    async def _admit(self, request, tenant: Tenant | None) -> tuple[SamplingParams, str]:
        """The request's model, ids and sampling params, checked before anything is sent anywhere, through the
        engine library's one input processor, built for the engines' model from their ModelInfo (the engine checks
        what the gateway cannot: --max-logprobs and the bad words' tokens). Returns the params and the LoRA adapter
        the model names ("" for the base model)."""
        lora_name = self._check_model(request.model, tenant)
        await self._get_processor()
        if (await self.deps.get_model_info()).runner_type == "pooling":
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the engines run --runner pooling (an embedding model): they embed prompts (Embed) and generate nothing",
            )
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

    async def _get_processor(self) -> Processor:
        """Admission for the engines' model, built from their ModelInfo on first use."""
        if self.processor is None:
            info = await self.deps.get_model_info()
            self.processor = Processor(info.vocab_size, info.max_model_len, info.eos_token_ids, self.limits)
        return self.processor

    async def _tokenize_prompt(self, request, metadata=()) -> tuple[list[int], list]:
        """The prompt's token ids and its images, preprocessed by the tokenizer (MultiModalInputs)."""
        if request.WhichOneof("prompt") == "token_ids":
            if request.images:
                raise invalid("images: a prompt with images must be text (the tokenizer expands their placeholders)")
            return list(request.token_ids.ids), []
        if not request.text:
            raise invalid("prompt is empty: set prompt text or token_ids")
        try:
            self.limits.check_chars("text", request.text, "max_prompt_chars")
        except ValueError as e:
            raise invalid(str(e)) from None
        reply = await self.deps.tokenize(
            tokenizer_pb2.TokenizeRequest(text=request.text, images=request.images), metadata
        )
        return list(reply.token_ids), list(reply.mm_inputs)

    async def _tokenize_chat(self, request, metadata=()) -> tuple[list[int], list]:
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
        if request.HasField("chat_template_kwargs"):
            chat.chat_template_kwargs.CopyFrom(request.chat_template_kwargs)
        if request.HasField("add_generation_prompt"):
            chat.add_generation_prompt = request.add_generation_prompt
        try:
            reply = await self.deps.tokenize(tokenizer_pb2.TokenizeRequest(chat=chat), metadata)
        except RequestError as e:
            raise chat_fields_named(e, bool(request.chat_template)) from None
        return list(reply.token_ids), list(reply.mm_inputs)

    async def _generate(
        self, request, context, request_id: str, params, prompt_ids, arrival: float, span, lora_name: str, mm_inputs
    ):
        req = GatewayRequest(self, request, request_id, params, prompt_ids, arrival, span, lora_name, mm_inputs)
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

    # ---- Embed -----------------------------------------------------------------------------------

    async def Embed(self, request, context):
        async def embed(tenant):
            if self._check_model(request.model, tenant):
                raise invalid(f"model: {request.model[:256]!r} is a LoRA adapter; embeddings are the base model's")
            info = await self.deps.get_model_info()
            if info.runner_type != "pooling":
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Embed: the engines run --runner {info.runner_type or 'generate'} (a generative model); "
                    "embeddings need engines serving an embedding model with --runner pooling",
                )
            processor = await self._get_processor()
            request_id = request.request_id or uuid.uuid4().hex
            try:
                processor.check_ids(request_id, request.cache_salt)
            except ValueError as e:
                raise invalid(str(e)) from None
            field = request.WhichOneof("input") or "text"
            if field == "token_ids":
                prompt_ids = list(request.token_ids.ids)
            elif not request.text:
                raise invalid("input is empty: set text or token_ids")
            else:
                try:
                    self.limits.check_chars("text", request.text, "max_prompt_chars")
                except ValueError as e:
                    raise invalid(str(e)) from None
                reply = await self.deps.tokenize(tokenizer_pb2.TokenizeRequest(text=request.text))
                prompt_ids = list(reply.token_ids)
            try:
                prompt_ids = processor.process_prompt(prompt_ids, PoolingParams())
            except ValueError as e:  # named as the client's field
                raise invalid(field + str(e).removeprefix("prompt_token_ids")) from None
            engine_request = engine_pb2.EngineEmbedRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                normalize=request.normalize if request.HasField("normalize") else None,
                priority=request.priority,
                cache_salt=tenant_salt(tenant, request.cache_salt),
            )
            if tenant is not None:
                tenant.take_tokens(context, len(prompt_ids))
            routed = self.deps.route(prompt_ids, engine_request.cache_salt)
            try:
                reply = await self.deps.embed(routed.address, engine_request, context.time_remaining(), ())
            finally:
                self.deps.release(routed)
            usage = common_pb2.Usage(prompt_tokens=reply.num_prompt_tokens, cached_tokens=reply.num_cached_tokens)
            return gateway_pb2.EmbedResponse(request_id=request_id, embedding=reply.embedding, usage=usage)

        return await self._unary(context, embed)

    # ---- the rest of the API ---------------------------------------------------------------------

    async def ListModels(self, request, context):
        async def list_models(tenant):
            # The models by name alone: vLLM's root is a path (the model's, an adapter's), which stays here.
            info = await self.deps.get_model_info()
            base = gateway_pb2.ModelCard(
                id=self.model, max_model_len=info.max_model_len, owned_by="llmmesh", root=self.model
            )
            adapters = [
                gateway_pb2.ModelCard(
                    id=name, max_model_len=info.max_model_len, owned_by="llmmesh", root=name, parent=self.model
                )
                for name in sorted(visible_adapters(tenant, self.deps.lora_adapter_paths()))
            ]
            return gateway_pb2.ListModelsResponse(models=[base, *adapters])

        return await self._unary(context, list_models)

    async def LoadLoraAdapter(self, request, context):
        return await self._unary(context, lambda tenant: self.deps.load_lora_adapter(own_adapter(tenant, request)))

    async def UnloadLoraAdapter(self, request, context):
        async def unload(tenant):
            engine_name = engine_adapter_name(tenant, request.lora_name)
            if tenant is not None and engine_name not in self.deps.lora_adapter_paths():
                raise RequestError(
                    grpc.StatusCode.NOT_FOUND,
                    f"lora_name {request.lora_name[:256]!r}: no adapter of yours by that name",
                )
            return await self.deps.unload_lora_adapter(common_pb2.UnloadLoraAdapterRequest(lora_name=engine_name))

        return await self._unary(context, unload)

    async def Tokenize(self, request, context):
        async def tokenize(_):
            if request.HasField("chat") and request.chat.chat_template and not self.trust_request_chat_template:
                raise invalid("chat.chat_template: a request may not bring its own chat template here")
            return await self.deps.tokenize(request)

        return await self._unary(context, tokenize)

    async def Detokenize(self, request, context):
        return await self._unary(context, lambda _: self.deps.detokenize(request))


def own_adapter(tenant: Tenant | None, request: common_pb2.LoadLoraAdapterRequest):
    """A tenant's LoadLoraAdapter as the engines get it: the adapter under the tenant's name, from the tenant's
    directory (services/tenants.py)."""
    if not request.lora_name or not request.lora_path:
        raise invalid("lora_name and lora_path are both required.")
    try:
        path = engine_adapter_path(tenant, request.lora_path)
    except ValueError as e:
        raise invalid(str(e)) from None
    return common_pb2.LoadLoraAdapterRequest(lora_name=engine_adapter_name(tenant, request.lora_name), lora_path=path)


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
        credentials(args, "gateway"),
        args.routing_log,
        args.step_timeout,
    )
    gateway = Gateway(
        deps,
        args.served_model_name,
        limits,
        args.max_requests_in_flight,
        load_tenants(args),
        args.trust_request_chat_template,
        args.migration_limit,
    )
    # The public port takes prompts of up to --max-prompt-chars (4 bytes a character at most) and their images, and
    # no more (the tokenizer checks each image against the same limits).
    max_receive_bytes = 4 * limits.max_prompt_chars + args.max_image_bytes + 2**20
    server = Server("gateway", [SERVICE_NAME], args, max_receive_bytes=max_receive_bytes, public=True)
    gateway.telemetry = server.telemetry
    server.telemetry.count("llmmesh:", gateway.counters)
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
    add_cli_args(parser, GatewayTLSConfig)
    add_cli_args(parser, ChatTemplateConfig)
    add_cli_args(parser, ImageBytesConfig)
    config.add_limit_args(parser)


def add_subcommands(subparsers) -> None:
    p = config.service_parser(subparsers, "gateway", "run the public llmmesh.v1.Gateway service", unix_socket=False)
    add_cli_args(p, GatewayFlags, grouped=False)
    # The engines' --step-timeout (serve passes it on): how long an engine may fail its health checks before the
    # gateway moves its streams.
    add_argument(p, next(f for f in dataclasses.fields(WatchdogConfig) if f.name == "step_timeout"))
    add_gateway_args(p)
    p.set_defaults(func=run)


def run(args) -> None:
    for name in ("engine", "tokenizer", "detokenizer"):
        if not getattr(args, name):
            raise ValueError(f"--{name} is required (the {name} service's HOST:PORT, or LLMMESH_{name.upper()}).")
    refuse_key_on_command_line(args)
    load_tenants(args)  # a bad keys file is refused before the server starts
    if args.max_requests_in_flight < 1:
        raise ValueError(f"max_requests_in_flight must be at least 1, got {args.max_requests_in_flight}.")
    check_step_timeouts(args.step_timeout, 0.0)
    if args.migration_limit < 0:
        raise ValueError(f"--migration-limit must be at least 0, got {args.migration_limit}.")
    if not 0 < args.prefill_timeout <= 3600:
        raise ValueError(f"--prefill-timeout must be a number of seconds in (0, 3600], got {args.prefill_timeout}.")
    config.run(serve(args), args)
