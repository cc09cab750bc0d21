"""The public API, llmmesh.v1.Gateway: validate, tokenize, send to an engine, detokenize, stream text back.

One request's path: check access and admission, validate the sampling parameters and the model name,
tokenize (the Tokenizer service), pick the engine with the fewest in-flight requests, open its Generate
stream, and pass every step's token ids through the shared Detokenizer stream, which returns text deltas
and stop-string hits. A client that goes away, a passed deadline or a stop-string hit that ends the last
unfinished completion cancels the engine call, which aborts the engine request and frees its blocks; a
stop-string hit in one of n > 1 completions while others go on aborts just its engine request (Abort).
"""

import argparse
import asyncio
import hmac
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.output_processor import child_request_id
from llmmesh.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.convert import sampling_params_from_proto
from services.grpc_server import CHANNEL_OPTIONS, Server

logger = logging.getLogger("llmmesh.gateway")

SERVICE_NAME = "llmmesh.v1.Gateway"
DEFAULT_MODEL = "smollm2-135m-instruct"
# gRPC's reconnect backoff grows to two minutes; a dependency restarted at the same address must be found
# again within a second or so.
DEPENDENCY_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
UNARY_TIMEOUT = 10.0  # s for a unary call to a dependency: a stuck one must not hang a request
DETOKENIZE_TIMEOUT = 10.0  # s to wait for the detokenizer's answer to one step
HEALTH_INTERVAL = 0.5  # s between dependency health checks
HEALTH_TIMEOUT = 1.0
CHAT_ROLES = ("system", "user", "assistant", "tool")
# Codes a dependency may answer that are about the request, not the dependency: passed on as they are.
REQUEST_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,  # the engine failed this request (its step raised)
)


class RequestError(Exception):
    """Ends a request with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def dependency_error(name: str, address: str, err: grpc.aio.AioRpcError) -> RequestError:
    if err.code() in REQUEST_CODES:
        return RequestError(err.code(), err.details() or f"{name}: {err.code().name}")
    return RequestError(grpc.StatusCode.UNAVAILABLE, f"the {name} at {address} is unavailable: {err.details()}")


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


# ---- the detokenizer link ------------------------------------------------------------------------


class DetokenizerStream:
    """One bidirectional stream to the Detokenizer, shared by the requests that started on it.

    Items queued in the same event-loop turn leave as one DetokenizeBatch, so concurrent requests'
    steps travel together. The detokenizer answers every item with one result, in order, so a
    request waits for as many results as it sent items. When the stream breaks (the detokenizer went away), every
    request on it fails with UNAVAILABLE; the gateway opens a new stream for the next requests.
    """

    def __init__(self, stub: detokenizer_pb2_grpc.DetokenizerStub, address: str):
        self.address = address
        self.error: RequestError | None = None
        self.outbox: list[detokenizer_pb2.DetokenizeItem] = []
        self.has_items = asyncio.Event()
        self.results: dict[str, asyncio.Queue] = {}
        self.call = stub.Detokenize(self._batches())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _batches(self):
        while True:
            await self.has_items.wait()
            self.has_items.clear()
            items, self.outbox = self.outbox, []
            yield detokenizer_pb2.DetokenizeBatch(items=items)

    async def _read(self) -> None:
        reason = "the stream ended"
        try:
            async for batch in self.call:
                for result in batch.results:
                    queue = self.results.get(result.request_id)
                    if queue is not None:
                        queue.put_nowait(result)
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            reason = "the stream was cancelled"
        self.error = RequestError(grpc.StatusCode.UNAVAILABLE, f"the detokenizer at {self.address} is unavailable: {reason}")
        for queue in self.results.values():  # wake every waiting request: its state is gone with the stream
            queue.put_nowait(self.error)

    def _send(self, items: list[detokenizer_pb2.DetokenizeItem]) -> None:
        self.outbox.extend(items)
        self.has_items.set()

    async def step(self, request_id: str, items: list[detokenizer_pb2.DetokenizeItem]) -> detokenizer_pb2.DetokenizeResult:
        """Send items for one request (ending in a step) and return the step's result.

        The detokenizer answers every item (start and close too) with one result, in order."""
        if self.error is not None:
            raise self.error
        queue = self.results.setdefault(request_id, asyncio.Queue())
        self._send(items)
        for _ in items:
            try:
                result = await asyncio.wait_for(queue.get(), DETOKENIZE_TIMEOUT)
            except TimeoutError:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the detokenizer at {self.address} did not answer within {DETOKENIZE_TIMEOUT:.0f} s",
                ) from None
            if isinstance(result, RequestError):
                raise result
            if result.error:  # the detokenizer refused an item: a request it cannot decode
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"detokenizer: {result.error}")
        return result

    def close(self, request_id: str, forget_remote: bool) -> None:
        """Stop tracking a request; forget_remote: also tell the detokenizer to drop its state."""
        if self.results.pop(request_id, None) is not None and forget_remote and self.error is None:
            self._send([detokenizer_pb2.DetokenizeItem(request_id=request_id, close=True)])

    def cancel(self) -> None:
        self.call.cancel()


# ---- one request ---------------------------------------------------------------------------------


@dataclass
class ChoiceState:
    """One of the n completions: what came so far and how it ended."""

    index: int
    detok_id: str
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float | None = None
    started: bool = False  # the detokenizer knows it
    finish_reason: str = ""
    stop_token_id: int | None = None
    stop_str: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def to_proto(self, with_output: bool) -> gateway_pb2.Choice:
        choice = gateway_pb2.Choice(index=self.index, finish_reason=self.finish_reason)
        if with_output:
            choice.text = "".join(self.text)
            choice.token_ids.extend(self.token_ids)
            choice.logprobs.extend(self.logprobs)
        if self.stop_str is not None:
            choice.stop_str = self.stop_str
        elif self.stop_token_id is not None:
            choice.stop_token_id = self.stop_token_id
        if self.cumulative_logprob is not None:
            choice.cumulative_logprob = self.cumulative_logprob
        return choice


def fill_decoded_tokens(positions, texts) -> None:
    """Set decoded_token on each entry, in order, from the detokenizer's token_texts."""
    texts = iter(texts)
    for position in positions:
        for entry in position.entries:
            entry.decoded_token = next(texts, "")


# ---- the service -------------------------------------------------------------------------------


class Gateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, model: str, engines: list[str], tokenizer: str, detokenizer: str,
                 max_waiting_requests: int = 1024, api_key: str | None = None):
        if not engines:
            raise ValueError("engine: give at least one engine address (--engine HOST:PORT).")
        self.model = model
        self.max_waiting_requests = max_waiting_requests
        self.api_key = api_key or None
        self.channels = {
            address: grpc.aio.insecure_channel(address, options=DEPENDENCY_CHANNEL_OPTIONS)
            for address in dict.fromkeys([*engines, tokenizer, detokenizer])
        }
        self.engines = {address: engine_pb2_grpc.EngineStub(self.channels[address]) for address in dict.fromkeys(engines)}
        self.engine_in_flight = dict.fromkeys(self.engines, 0)
        self.healthy_engines: set[str] = set()
        self.tokenizer_address, self.detokenizer_address = tokenizer, detokenizer
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.channels[tokenizer])
        self.detokenizer_stub = detokenizer_pb2_grpc.DetokenizerStub(self.channels[detokenizer])
        self.detokenizer: DetokenizerStream | None = None
        self.max_model_len: int | None = None  # set with vocab_size, from the engines' GetModelInfo
        self.vocab_size: int | None = None
        self.num_in_flight = 0
        self.draining = False
        self.ready = asyncio.Event()  # set the first time every dependency answered its health check

    # ---- health ----------------------------------------------------------------------------------

    async def _healthy(self, address: str) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(self.channels[address]).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def check_dependencies(self) -> bool:
        engines = list(self.engines)
        results = await asyncio.gather(*(self._healthy(a) for a in [self.tokenizer_address, self.detokenizer_address, *engines]))
        self.healthy_engines = {a for a, ok in zip(engines, results[2:]) if ok}
        if self.healthy_engines and self.max_model_len is None:
            try:
                await self._load_model_info()
            except RequestError:
                return False
        return all(results[:2]) and bool(self.healthy_engines)

    async def monitor(self, server: Server) -> None:
        """Keep the gateway's health in step with its dependencies' (NOT_SERVING until all answer)."""
        serving = None
        while not self.draining:
            ok = await self.check_dependencies()
            if ok != serving and not self.draining:
                await server.set_serving(ok)
                serving = ok
                logger.info("dependencies %s", "healthy: SERVING" if ok else "not all healthy: NOT_SERVING")
            if ok:
                self.ready.set()
            await asyncio.sleep(HEALTH_INTERVAL)

    async def _load_model_info(self) -> int:
        """The smallest max_model_len (the prompt limit) and vocab_size across the healthy engines."""
        infos = []
        for address in self.healthy_engines or self.engines:
            engine = self.engines[address]
            try:
                infos.append(await engine.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=UNARY_TIMEOUT))
            except grpc.aio.AioRpcError as e:
                raise dependency_error("engine", address, e) from None
        self.vocab_size = min(info.vocab_size for info in infos)
        self.max_model_len = min(info.max_model_len for info in infos)
        return self.max_model_len

    async def _get_max_model_len(self) -> int:
        return self.max_model_len if self.max_model_len is not None else await self._load_model_info()

    # ---- access ----------------------------------------------------------------------------------

    def _check_access(self, context) -> None:
        if self.api_key is not None:
            metadata = dict(context.invocation_metadata() or ())
            given = metadata.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise RequestError(
                    grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be 'Bearer <api key>'"
                )
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")

    async def _unary(self, context, call):
        try:
            self._check_access(context)
            return await call()
        except RequestError as e:
            await context.abort(e.code, e.message)

    # ---- Generate / Chat -------------------------------------------------------------------------

    async def Generate(self, request, context):
        async for response in self._serve(request, context, lambda: self._tokenize_prompt(request)):
            yield response

    async def Chat(self, request, context):
        async for response in self._serve(request, context, lambda: self._tokenize_chat(request)):
            yield response

    async def _serve(self, request, context, tokenize):
        arrival = time.monotonic()
        try:
            self._check_access(context)
            if self.num_in_flight >= self.max_waiting_requests:
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the gateway has {self.num_in_flight} requests in flight, its limit "
                    f"(--max-waiting-requests={self.max_waiting_requests}); retry later",
                )
            self.num_in_flight += 1
            try:
                if request.model and request.model != self.model:
                    raise invalid(f"model {request.model!r} is not served here; the served model is {self.model!r}")
                try:
                    params = sampling_params_from_proto(request.sampling_params)
                except ValueError as e:
                    raise invalid(f"sampling_params: {e}") from None
                prompt_ids = await tokenize()
                max_model_len = await self._get_max_model_len()
                if params.truncate_prompt_tokens is not None:
                    keep = max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
                    prompt_ids = prompt_ids[-keep:]
                if not prompt_ids:
                    raise invalid("prompt is empty: it must hold at least one token")
                if len(prompt_ids) >= max_model_len:
                    raise invalid(
                        f"prompt is {len(prompt_ids)} tokens long; the model takes at most {max_model_len - 1} "
                        f"(max_model_len={max_model_len}, and one token must be generated)"
                    )
                async for response in self._generate(request, context, params.n, prompt_ids, arrival):
                    yield response
            finally:
                self.num_in_flight -= 1
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def _tokenize_prompt(self, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            await self._get_max_model_len()  # and vocab_size
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid(
                    f"token_ids: token id {bad[0]} is out of vocabulary; token ids must be in [0, {self.vocab_size})"
                )
            return ids
        if not request.text:
            raise invalid("prompt is empty: set prompt text or token_ids")
        return await self._tokenize(tokenizer_pb2.TokenizeRequest(text=request.text))

    async def _tokenize_chat(self, request) -> list[int]:
        if not request.messages:
            raise invalid("messages is empty: a chat needs at least one message")
        for i, message in enumerate(request.messages):
            if message.role not in CHAT_ROLES:
                raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}")
        chat = tokenizer_pb2.ChatInput(messages=request.messages, chat_template=request.chat_template)
        if request.HasField("add_generation_prompt"):
            chat.add_generation_prompt = request.add_generation_prompt
        return await self._tokenize(tokenizer_pb2.TokenizeRequest(chat=chat))

    async def _tokenize(self, tokenize_request) -> list[int]:
        try:
            reply = await self.tokenizer.Tokenize(tokenize_request, timeout=UNARY_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            raise dependency_error("tokenizer", self.tokenizer_address, e) from None
        return list(reply.token_ids)

    def _detokenizer_stream(self) -> DetokenizerStream:
        if self.detokenizer is None or self.detokenizer.error is not None:
            self.detokenizer = DetokenizerStream(self.detokenizer_stub, self.detokenizer_address)
        return self.detokenizer

    def _pick_engine(self) -> str:
        candidates = self.healthy_engines or self.engines
        return min(candidates, key=lambda address: self.engine_in_flight[address])

    async def _generate(self, request, context, n: int, prompt_ids: list[int], arrival: float):
        request_id = request.request_id or uuid.uuid4().hex
        # Unique at the engine even when clients reuse ids.
        engine_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if request.request_id else request_id
        sp = request.sampling_params
        engine_params = common_pb2.SamplingParams()
        engine_params.CopyFrom(sp)
        del engine_params.stop[:]  # stop strings are the detokenizer's job
        choices = [ChoiceState(i, f"{engine_request_id}/{i}") for i in range(n)]
        if sp.HasField("logprobs"):
            for c in choices:
                c.cumulative_logprob = 0.0
        start = detokenizer_pb2.DetokenizeStart(
            prompt_token_ids=prompt_ids, stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output,
            min_tokens=sp.min_tokens,
        )
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if sp.HasField(name):
                setattr(start, name, getattr(sp, name))

        address = self._pick_engine()
        self.engine_in_flight[address] += 1
        engine = self.engines[address]
        call = engine.Generate(
            engine_pb2.EngineGenerateRequest(
                request_id=engine_request_id, prompt_token_ids=prompt_ids, sampling_params=engine_params,
                priority=request.priority, cache_salt=request.cache_salt,
            ),
            timeout=context.time_remaining(),  # the client's deadline ends the engine request too
        )
        context.add_done_callback(lambda _: call.cancel())  # even if this generator is never resumed
        detokenizer = self._detokenizer_stream()
        prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        cached_tokens, queue_time, first_token_time = 0, None, None
        try:
            try:
                async for out in call:
                    choice = choices[out.index]
                    if choice.finished:
                        continue  # a stop string ended it; the engine abort is on its way
                    ids = list(out.token_ids)
                    if ids and first_token_time is None:
                        first_token_time = time.monotonic()
                    positions = [*out.logprobs, *out.prompt_logprobs]
                    items = []
                    if not choice.started:
                        items.append(detokenizer_pb2.DetokenizeItem(request_id=choice.detok_id, start=start))
                        choice.started = True
                    items.append(detokenizer_pb2.DetokenizeItem(request_id=choice.detok_id, step=detokenizer_pb2.DetokenizeStep(
                        token_ids=ids,
                        finished=bool(out.finish_reason),
                        stop_terminated=out.finish_reason == "stop",  # the engine stops on tokens only
                        text_of_token_ids=[e.token_id for p in positions for e in p.entries],
                    )))
                    result = await detokenizer.step(choice.detok_id, items)
                    fill_decoded_tokens(positions, result.token_texts)

                    choice.text.append(result.text)
                    choice.token_ids.extend(ids)
                    choice.logprobs.extend(out.logprobs)
                    if choice.cumulative_logprob is not None:
                        choice.cumulative_logprob += sum(p.entries[0].logprob for p in out.logprobs if p.entries)
                    prompt_logprobs.extend(out.prompt_logprobs)
                    if out.HasField("usage"):
                        cached_tokens = max(cached_tokens, out.usage.cached_tokens)
                    if out.HasField("timings") and queue_time is None:
                        queue_time = out.timings.queue_time
                    if result.stop_str:
                        choice.finish_reason, choice.stop_str = "stop", result.stop_str
                        detokenizer.close(choice.detok_id, forget_remote=True)
                        if n > 1 and not out.finish_reason and not all(c.finished for c in choices):
                            # End this completion's engine request alone (its blocks are free next step);
                            # the others go on. Its outputs until then are skipped above.
                            await self._abort_engine_request(address, child_request_id(choice.index, engine_request_id))
                    elif out.finish_reason:
                        choice.finish_reason = out.finish_reason
                        if out.WhichOneof("stop_reason") == "stop_token_id":
                            choice.stop_token_id = out.stop_token_id
                        detokenizer.close(choice.detok_id, forget_remote=False)
                    if request.stream and (ids or result.text):
                        delta = gateway_pb2.ChoiceDelta(index=choice.index, text=result.text, token_ids=ids, logprobs=out.logprobs)
                        yield gateway_pb2.GenerateResponse(request_id=request_id, chunk=gateway_pb2.Chunk(choices=[delta]))
                    if all(c.finished for c in choices):
                        break
            except grpc.aio.AioRpcError as e:
                raise dependency_error("engine", address, e) from None
            for c in choices:
                c.finish_reason = c.finish_reason or "abort"  # the engine stream ended without finishing it
            now = time.monotonic()
            complete = gateway_pb2.Complete(
                choices=[c.to_proto(with_output=not request.stream) for c in choices],
                usage=common_pb2.Usage(
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=sum(len(c.token_ids) for c in choices),
                    cached_tokens=cached_tokens,
                ),
                # Time to first token and end to end as the client sees them from the gateway; time in the
                # engine's queue as the engine measured it (sent with the first tokens).
                timings=common_pb2.Timings(
                    queue_time=queue_time or 0.0,
                    time_to_first_token=(first_token_time or now) - arrival,
                    e2e_latency=now - arrival,
                ),
                prompt_logprobs=prompt_logprobs,
            )
            yield gateway_pb2.GenerateResponse(request_id=request_id, complete=complete)
        finally:
            # Finished, failed, cancelled by the client or past its deadline: end the engine request now.
            call.cancel()
            self.engine_in_flight[address] -= 1
            for c in choices:
                detokenizer.close(c.detok_id, forget_remote=c.started and not c.finished)

    async def _abort_engine_request(self, address: str, engine_request_id: str) -> None:
        request = engine_pb2.AbortRequest(request_ids=[engine_request_id])
        try:
            await self.engines[address].Abort(request, timeout=UNARY_TIMEOUT)
        except grpc.aio.AioRpcError as e:  # not the request's failure: it still ends when the engine call does
            logger.warning("could not abort %s at the engine %s: %s", engine_request_id, address, e.details())

    # ---- the rest of the API ---------------------------------------------------------------------

    async def ListModels(self, request, context):
        async def list_models():
            return gateway_pb2.ListModelsResponse(models=[
                gateway_pb2.ModelCard(id=self.model, max_model_len=await self._get_max_model_len(), owned_by="llmmesh")
            ])
        return await self._unary(context, list_models)

    async def Tokenize(self, request, context):
        return await self._unary(context, lambda: self._pass_through(self.tokenizer.Tokenize, request))

    async def Detokenize(self, request, context):
        return await self._unary(context, lambda: self._pass_through(self.tokenizer.Detokenize, request))

    async def _pass_through(self, method, request):
        try:
            return await method(request, timeout=UNARY_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            raise dependency_error("tokenizer", self.tokenizer_address, e) from None

    async def close(self) -> None:
        if self.detokenizer is not None:
            self.detokenizer.cancel()
        for channel in self.channels.values():
            await channel.close()


# ---- the process ---------------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    gateway = Gateway(args.model, args.engine, args.tokenizer, args.detokenizer, args.max_waiting_requests, args.api_key)
    server = Server([SERVICE_NAME], args.host, args.port)
    gateway_pb2_grpc.add_GatewayServicer_to_server(gateway, server.server)
    await server.start()  # from here SIGINT/SIGTERM set server.stop_requested
    monitor = asyncio.create_task(gateway.monitor(server))
    ready = asyncio.create_task(gateway.ready.wait())
    stopping = asyncio.create_task(server.stop_requested.wait())
    await asyncio.wait([ready, stopping], return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        print(f"llmmesh gateway listening on {server.address}", flush=True)
    await stopping
    # Drain: new requests get UNAVAILABLE, in-flight ones have shutdown_timeout seconds to finish.
    logger.info("shutting down (up to %.0f s for %d in-flight requests)", args.shutdown_timeout, gateway.num_in_flight)
    gateway.draining = True
    monitor.cancel()
    ready.cancel()
    await server.stop(args.shutdown_timeout)
    await gateway.close()


def _env(name: str, default):
    return os.environ.get("LLMMESH_" + name.upper(), default)


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """The gateway's own flags (not the addresses of its dependencies), each with an LLMMESH_ variable."""
    parser.add_argument("--max-waiting-requests", type=int, default=int(_env("max_waiting_requests", 1024)),
                        help="requests in flight past which new ones get RESOURCE_EXHAUSTED")
    parser.add_argument("--api-key", default=_env("api_key", None),
                        help="require metadata 'authorization: Bearer KEY'")
    parser.add_argument("--shutdown-timeout", type=float, default=float(_env("shutdown_timeout", 30.0)),
                        help="seconds in-flight requests get to finish on SIGTERM")


def _addresses(value: str | None) -> list[str]:
    return [a for a in (value or "").split(",") if a]


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="run the public llmmesh.v1.Gateway service")
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("port", 8000)))
    p.add_argument("--engine", action="append", default=None,
                   help="an engine address HOST:PORT (repeatable; LLMMESH_ENGINE takes a comma-separated list)")
    p.add_argument("--tokenizer", default=_env("tokenizer", None), help="the tokenizer service's HOST:PORT")
    p.add_argument("--detokenizer", default=_env("detokenizer", None), help="the detokenizer service's HOST:PORT")
    p.add_argument("--model", default=_env("model", DEFAULT_MODEL), help="the model name clients may ask for")
    add_gateway_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    args.engine = args.engine or _addresses(_env("engine", None))
    for name in ("engine", "tokenizer", "detokenizer"):
        if not getattr(args, name):
            raise ValueError(f"--{name} is required (the {name} service's HOST:PORT, or LLMMESH_{name.upper()}).")
    if args.max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be at least 1, got {args.max_waiting_requests}.")
    asyncio.run(serve(args))
