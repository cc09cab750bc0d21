"""The gateway's dependencies: channels to the engines, tokenizer and detokenizer, their health, and routing.

A monitor checks every dependency's gRPC health twice a second and keeps the gateway's own health in
step (NOT_SERVING until all answer); with prefix-aware routing it also reads each healthy engine's GetLoad then,
and follows each engine's KV events (services/routing.py chooses the engine). With no healthy engine, requests
fail at once with UNAVAILABLE rather than wait on a dead one. The gateway calls its dependencies through the
methods of Dependencies alone, each named for what it does, and never reads its stubs, router or health sets.
"""

import asyncio
import itertools
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.limits import RequestLimits
from llmmesh.v1 import common_pb2, detokenizer_pb2_grpc, engine_pb2, engine_pb2_grpc, tokenizer_pb2_grpc
from mesh.tls import MeshCredentials
from services.detokenizer_client import DetokenizerStream
from services.errors import RequestError, dependency_error, unavailable
from services.routing import Routed, Router
from services.server import Server, channel

logger = logging.getLogger("llmmesh.gateway")

UNARY_TIMEOUT = 10.0  # s for a unary call to a dependency: a stuck one must not hang a request
HEALTH_INTERVAL = 0.5  # s between dependency health checks
HEALTH_TIMEOUT = 1.0
# Health checks in a row that may time out before a dependency counts as down: a busy one answers late, while one
# that is gone refuses at once (and an engine's restart ends its KV event stream, which drops its blocks).
HEALTH_MISSES = 3
KV_EVENTS_RETRY_S = 1.0  # s before subscribing again to an engine's KV events after its stream ended
KV_EVENTS_OFF_RETRY_S = 30.0  # ... after the engine said its KV events are off
LORA_LOAD_TIMEOUT = 60.0  # s an engine may take to read a LoRA adapter from its directory
# How an engine that is going away ends a call before its first message: UNAVAILABLE (stopped, unreachable), or
# CANCELLED for a call that reached its server as the server began to stop (gRPC cancels calls not yet handled).
# The gateway's own cancel raises asyncio.CancelledError instead, and the engine never answers CANCELLED itself.
ENGINE_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# An engine out of reach for now: gone, or late past the call's deadline.
ENGINE_DOWN = (*ENGINE_GONE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Dependencies:
    def __init__(
        self,
        engines: list[str],
        tokenizer: str,
        detokenizer: str,
        max_batch: int = RequestLimits.max_batch,
        routing: str | None = None,
        prefill_engines: list[str] = (),
        prefill_timeout: float = 30.0,
        credentials: MeshCredentials | None = None,
        routing_log: str | None = None,
    ):
        """credentials: the gateway's own, presented on every channel (None: plaintext); routing_log: a file the
        router appends each decision to, as a JSON line (services/routing.py)."""
        self.max_batch = max_batch  # items per DetokenizeBatch: the detokenizer's --max-batch (serve gives both one)
        if not engines:
            raise ValueError("engine: give at least one engine address (--engine HOST:PORT).")
        servers = {address: "engine" for address in [*engines, *prefill_engines]}
        servers.update({tokenizer: "tokenizer", detokenizer: "detokenizer"})
        self.channels = {address: channel(address, server, credentials) for address, server in servers.items()}
        # kv_producer engines for disaggregated prefill (the engines above are then kv_consumers), taken in turn
        self.prefill_engines = {
            address: engine_pb2_grpc.EngineStub(self.channels[address]) for address in dict.fromkeys(prefill_engines)
        }
        self.prefill_turn = itertools.cycle(self.prefill_engines)
        self.healthy_prefill_engines: set[str] = set()
        self.prefill_timeout = prefill_timeout  # s a prefill may take before the decode engine computes the prompt
        self.engines = {
            address: engine_pb2_grpc.EngineStub(self.channels[address]) for address in dict.fromkeys(engines)
        }
        # prefix-aware by default with more than one engine; with one there is nothing to choose
        routing = routing or ("prefix-aware" if len(self.engines) > 1 else "least-loaded")
        self.decision_log = open(routing_log, "a", encoding="utf-8") if routing_log else None
        self.router = Router(list(self.engines), routing, decision_log=self.decision_log)
        self.kv_event_tasks: list[asyncio.Task] = []
        self.healthy_engines: set[str] = set()
        self.health_misses: dict[str, int] = {}  # address -> health checks since it last answered SERVING
        self.tokenizer_address, self.detokenizer_address = tokenizer, detokenizer
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.channels[tokenizer])
        self.detokenizer_stub = detokenizer_pb2_grpc.DetokenizerStub(self.channels[detokenizer])
        self.detokenizer: DetokenizerStream | None = None
        self.model_info: engine_pb2.ModelInfo | None = None  # the smallest max_model_len and vocab of the engines
        self.enable_lora = False  # whether any engine serves LoRA adapters (its ModelInfo)
        self.lora_adapters: dict[str, dict[str, engine_pb2.LoraAdapter]] = {}  # engine address -> its adapters by name
        self.ready = asyncio.Event()  # set the first time every dependency answered its health check

    async def _healthy(self, address: str) -> bool:
        """SERVING, or late to answer fewer than HEALTH_MISSES times in a row since it last was."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channels[address]).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT
            )
        except grpc.aio.AioRpcError as e:
            late = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            misses = self.health_misses.get(address, HEALTH_MISSES) + 1 if late else HEALTH_MISSES
        else:
            misses = 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else HEALTH_MISSES
        self.health_misses[address] = misses
        return misses < HEALTH_MISSES

    async def check(self) -> bool:
        """Every dependency's health; the gateway's own. Prefill engines are checked but optional: without a healthy
        one, the decode engines compute the prompts."""
        engines, prefill_engines = list(self.engines), list(self.prefill_engines)
        results = await asyncio.gather(
            *(self._healthy(a) for a in [self.tokenizer_address, self.detokenizer_address, *engines, *prefill_engines])
        )
        self.healthy_engines = {a for a, ok in zip(engines, results[2:]) if ok}
        self.healthy_prefill_engines = {a for a, ok in zip(prefill_engines, results[2 + len(engines) :]) if ok}
        if self.healthy_engines and self.model_info is None:
            try:
                await self.load_model_info()
            except RequestError:
                return False
        if self.router.policy == "prefix-aware":
            await asyncio.gather(*(self._read_load(address) for address in self.answering_engines()))
        if self.enable_lora:
            await self.read_lora_adapters()
        return all(results[:2]) and bool(self.healthy_engines)

    async def read_lora_adapters(self) -> None:
        """Which LoRA adapters each healthy engine has (ListLoraAdapters): requests naming one go to those."""

        async def read(address: str) -> None:
            try:
                reply = await self.engines[address].ListLoraAdapters(
                    engine_pb2.ListLoraAdaptersRequest(), timeout=HEALTH_TIMEOUT
                )
            except grpc.aio.AioRpcError:
                return  # its health check says the rest
            self.lora_adapters[address] = {a.lora_name: a for a in reply.adapters}

        await asyncio.gather(*(read(address) for address in self.answering_engines()))

    def answering_engines(self) -> set[str]:
        """The healthy engines that answered their last health check: one that was late would be late again to
        the calls made with the checks, and hold up the next check."""
        return {a for a in self.healthy_engines if not self.health_misses.get(a)}

    async def _read_load(self, address: str) -> None:
        try:
            reply = await self.engines[address].GetLoad(engine_pb2.GetLoadRequest(), timeout=HEALTH_TIMEOUT)
        except grpc.aio.AioRpcError:
            return  # its health check says the rest
        self.router.update_load(address, reply)

    async def follow_kv_events(self, address: str) -> None:
        """Keep the router's index of this engine's blocks from its KV event stream, subscribing again whenever the
        stream ends. Each new stream starts from nothing (the engine may have restarted): its old entries go."""
        engine = self.router.engine_index(address)
        while True:
            call = self.engines[address].SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest())
            retry = KV_EVENTS_RETRY_S
            try:
                await call.initial_metadata()
                self.router.index.drop_engine(engine)
                last = None
                async for batch in call:
                    if last is not None and batch.sequence_number != last + 1:
                        logger.debug("KV events from %s: batches %d..%d lost", address, last + 1, batch.sequence_number)
                    last = batch.sequence_number
                    self.router.apply_events(address, batch)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                    message = "the engine %s sends no KV events (%s): routing to it by load alone"
                    logger.warning(message, address, e.details())
                    retry = KV_EVENTS_OFF_RETRY_S
            finally:
                call.cancel()
            self.router.index.drop_engine(engine)
            await asyncio.sleep(retry)

    async def monitor(self, server: Server, stopping: asyncio.Event) -> None:
        """Keep the gateway's health in step with its dependencies', and the router's index with the engines'
        KV events."""
        if self.router.policy == "prefix-aware" and not self.kv_event_tasks:
            self.kv_event_tasks = [asyncio.create_task(self.follow_kv_events(a)) for a in self.engines]
        serving = None
        while not stopping.is_set():
            ok = await self.check()
            if ok != serving and not stopping.is_set():
                await server.set_serving(ok)
                serving = ok
                logger.info("dependencies %s", "healthy: SERVING" if ok else "not all healthy: NOT_SERVING")
            if ok:
                self.ready.set()
            await asyncio.sleep(HEALTH_INTERVAL)

    async def load_model_info(self) -> engine_pb2.ModelInfo:
        infos = []
        for address in self.healthy_engines or self.engines:
            try:
                infos.append(
                    await self.engines[address].GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=UNARY_TIMEOUT)
                )
            except grpc.aio.AioRpcError as e:
                raise dependency_error("engine", address, e) from None
        self.model_info = min(infos, key=lambda info: (info.max_model_len, info.vocab_size))
        self.enable_lora = any(info.enable_lora for info in infos)
        self.router.set_model_info(self.model_info)
        return self.model_info

    async def get_model_info(self) -> engine_pb2.ModelInfo:
        return self.model_info if self.model_info is not None else await self.load_model_info()

    def prefill_engine(self) -> str | None:
        """The next healthy prefill engine in turn; None when none is."""
        for _ in self.prefill_engines:
            address = next(self.prefill_turn)
            if address in self.healthy_prefill_engines:
                return address
        return None

    def route(
        self, prompt_ids: list[int], cache_salt: str = "", exclude=(), lora_name: str = "", mm_features=()
    ) -> Routed:
        """The engine for this prompt, among the healthy ones not excluded that have its LoRA adapter, if it names
        one (router.release(...) once it ends). mm_features: its images (MultiModalInputs)."""
        candidates = self.healthy_engines.difference(exclude)
        lora_key = None
        if lora_name:
            candidates = {a for a in candidates if lora_name in self.lora_adapters.get(a, {})}
            if not candidates and not any(lora_name in adapters for adapters in self.lora_adapters.values()):
                raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {lora_name!r}: no engine has this LoRA adapter")
            if not candidates:
                raise unavailable(
                    f"no healthy engine has the LoRA adapter {lora_name!r} (engines: {', '.join(self.engines)})"
                )
            lora_key = self.lora_adapters[next(iter(candidates))][lora_name].digest or None
        if not candidates:
            raise unavailable(f"no engine is healthy (engines: {', '.join(self.engines)})")
        return self.router.route(candidates, prompt_ids, cache_salt, lora_key, mm_features)

    def any_healthy_engine(self, exclude=()) -> bool:
        """Whether some engine not excluded is healthy."""
        return bool(self.healthy_engines.difference(exclude))

    def disaggregated(self) -> bool:
        """Whether prefill engines compute the prompts (vLLM's disaggregated prefill)."""
        return bool(self.prefill_engines)

    def generate(self, address: str, request: engine_pb2.EngineGenerateRequest, timeout, metadata):
        """Open a Generate call on an engine."""
        return self.engines[address].Generate(request, timeout=timeout, metadata=metadata)

    async def embed(self, address: str, request: engine_pb2.EngineEmbedRequest, timeout, metadata):
        """One Embed call on an engine."""
        try:
            return await self.engines[address].Embed(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise dependency_error("engine", address, e) from None

    def prefill(self, address: str, request: engine_pb2.EngineGenerateRequest, time_remaining, metadata):
        """Open a Generate call on a prefill engine: a hung one costs at most --prefill-timeout (or the time the
        client has left)."""
        timeout = self.prefill_timeout
        if time_remaining is not None:
            timeout = min(timeout, time_remaining)
        return self.prefill_engines[address].Generate(request, timeout=timeout, metadata=metadata)

    def first_token(self, routed: Routed) -> None:
        """A routed request's prefill is done: it decodes from now on."""
        self.router.first_token(routed)

    def release(self, routed: Routed) -> None:
        """A routed request ended, however."""
        self.router.release(routed)

    def mark_down(self, address: str) -> None:
        """No new requests for this engine until its next health check. Its blocks stay in the router's index: if
        it restarted, its KV event stream ended and took them."""
        self.healthy_engines.discard(address)

    def mark_prefill_down(self, address: str) -> None:
        """No prefills on this prefill engine until its next health check."""
        self.healthy_prefill_engines.discard(address)

    def model_name(self) -> str:
        """The engines' model; "" until their ModelInfo is in."""
        return self.model_info.model if self.model_info is not None else ""

    def lora_adapter_paths(self) -> dict[str, str]:
        """The LoRA adapters some engine has: name -> path (vLLM lists them as models beside the base model)."""
        return {name: a.lora_path for adapters in self.lora_adapters.values() for name, a in adapters.items()}

    async def load_lora_adapter(self, request: common_pb2.LoadLoraAdapterRequest):
        return await self._on_every_engine("LoadLoraAdapter", request)

    async def unload_lora_adapter(self, request: common_pb2.UnloadLoraAdapterRequest):
        return await self._on_every_engine("UnloadLoraAdapter", request)

    async def _on_every_engine(self, method: str, request):
        """vLLM's load/unload_lora_adapter on every engine (prefill engines too), all or nothing: where some already
        had it (ALREADY_EXISTS) or lacked it (NOT_FOUND) and the others did it, that is done; where an engine refuses
        (an unload while the adapter runs there, say), the engines that did it are undone (the adapter loaded again
        from the path each had, or unloaded) and the first refusal is the answer, naming its engine. The adapters'
        list is read again either way."""
        stubs = {**self.engines, **self.prefill_engines}

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
        await self.read_lora_adapters()
        if refusals or len(errors) == len(replies):
            address, e = next(iter((refusals or errors).items()))
            if e.code() in ENGINE_DOWN:
                raise unavailable(f"the engine at {address} is unavailable: {e.details()}")
            raise RequestError(e.code(), f"engine {address}: {e.details()}")
        return next(r for r in replies.values() if not isinstance(r, grpc.aio.AioRpcError))

    def detokenizer_stream(self) -> DetokenizerStream:
        if self.detokenizer is None or self.detokenizer.error is not None:
            self.detokenizer = DetokenizerStream(self.detokenizer_stub, self.detokenizer_address, self.max_batch)
        return self.detokenizer

    async def tokenize(self, request, metadata=()):
        try:
            return await self.tokenizer.Tokenize(request, timeout=UNARY_TIMEOUT, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise dependency_error("tokenizer", self.tokenizer_address, e) from None

    async def detokenize(self, request):
        try:
            return await self.tokenizer.Detokenize(request, timeout=UNARY_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            raise dependency_error("tokenizer", self.tokenizer_address, e) from None

    async def abort(self, address: str, engine_request_id: str, metadata=(), stop_string: bool = False) -> bool:
        """End one engine request; False when the engine could not be told (it still ends with the call)."""
        request = engine_pb2.AbortRequest(request_ids=[engine_request_id], stop_string=stop_string)
        try:
            await self.engines[address].Abort(request, timeout=UNARY_TIMEOUT, metadata=metadata)
        except grpc.aio.AioRpcError as e:  # not the request's failure: it still ends when the engine call does
            logger.warning("could not abort %s at the engine %s: %s", engine_request_id, address, e.details())
            return False
        return True

    async def close(self) -> None:
        for task in self.kv_event_tasks:
            task.cancel()
        if self.detokenizer is not None:
            self.detokenizer.cancel()
        for ch in self.channels.values():
            await ch.close()
        if self.decision_log is not None:
            self.decision_log.close()
