"""The gateway's dependencies: channels to the engines, tokenizer and detokenizer, their health, and routing.

A monitor checks every dependency's gRPC health twice a second and keeps the gateway's own health in
step (NOT_SERVING until all answer). Requests go to the healthy engine with the fewest in flight; with
no healthy engine they fail at once with UNAVAILABLE rather than wait on a dead one.
"""

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.limits import RequestLimits
from llmmesh.v1 import detokenizer_pb2_grpc, engine_pb2, engine_pb2_grpc, tokenizer_pb2_grpc
from services.detokenizer_client import DetokenizerStream
from services.errors import RequestError, dependency_error, unavailable
from services.server import Server, channel

logger = logging.getLogger("llmmesh.gateway")

UNARY_TIMEOUT = 10.0  # s for a unary call to a dependency: a stuck one must not hang a request
HEALTH_INTERVAL = 0.5  # s between dependency health checks
HEALTH_TIMEOUT = 1.0


class Dependencies:
    def __init__(self, engines: list[str], tokenizer: str, detokenizer: str, max_batch: int = RequestLimits.max_batch):
        self.max_batch = max_batch  # items per DetokenizeBatch: the detokenizer's --max-batch (serve gives both one)
        if not engines:
            raise ValueError("engine: give at least one engine address (--engine HOST:PORT).")
        self.channels = {address: channel(address) for address in dict.fromkeys([*engines, tokenizer, detokenizer])}
        self.engines = {
            address: engine_pb2_grpc.EngineStub(self.channels[address]) for address in dict.fromkeys(engines)
        }
        self.engine_in_flight = dict.fromkeys(self.engines, 0)
        self.healthy_engines: set[str] = set()
        self.tokenizer_address, self.detokenizer_address = tokenizer, detokenizer
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.channels[tokenizer])
        self.detokenizer_stub = detokenizer_pb2_grpc.DetokenizerStub(self.channels[detokenizer])
        self.detokenizer: DetokenizerStream | None = None
        self.model_info: engine_pb2.ModelInfo | None = None  # the smallest max_model_len and vocab of the engines
        self.ready = asyncio.Event()  # set the first time every dependency answered its health check

    async def _healthy(self, address: str) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(self.channels[address]).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def check(self) -> bool:
        engines = list(self.engines)
        results = await asyncio.gather(
            *(self._healthy(a) for a in [self.tokenizer_address, self.detokenizer_address, *engines])
        )
        self.healthy_engines = {a for a, ok in zip(engines, results[2:]) if ok}
        if self.healthy_engines and self.model_info is None:
            try:
                await self.load_model_info()
            except RequestError:
                return False
        return all(results[:2]) and bool(self.healthy_engines)

    async def monitor(self, server: Server, stopping: asyncio.Event) -> None:
        """Keep the gateway's health in step with its dependencies'."""
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
        return self.model_info

    async def get_model_info(self) -> engine_pb2.ModelInfo:
        return self.model_info if self.model_info is not None else await self.load_model_info()

    def pick_engine(self) -> str:
        if not self.healthy_engines:
            raise unavailable(f"no engine is healthy (engines: {', '.join(self.engines)})")
        return min(self.healthy_engines, key=lambda address: self.engine_in_flight[address])

    def detokenizer_stream(self) -> DetokenizerStream:
        if self.detokenizer is None or self.detokenizer.error is not None:
            self.detokenizer = DetokenizerStream(self.detokenizer_stub, self.detokenizer_address, self.max_batch)
        return self.detokenizer

    async def tokenize(self, request, metadata=()):
        try:
            return await self.tokenizer.Tokenize(request, timeout=UNARY_TIMEOUT, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise dependency_error("tokenizer", self.tokenizer_address, e) from None

    async def abort(self, address: str, engine_request_id: str, metadata=()) -> None:
        request = engine_pb2.AbortRequest(request_ids=[engine_request_id])
        try:
            await self.engines[address].Abort(request, timeout=UNARY_TIMEOUT, metadata=metadata)
        except grpc.aio.AioRpcError as e:  # not the request's failure: it still ends when the engine call does
            logger.warning("could not abort %s at the engine %s: %s", engine_request_id, address, e.details())

    async def close(self) -> None:
        if self.detokenizer is not None:
            self.detokenizer.cancel()
        for ch in self.channels.values():
            await ch.close()
