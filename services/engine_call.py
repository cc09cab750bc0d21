"""The gateway's Generate call to an engine for one request: routed, opened, read by a task of its own, and sent
to another engine when the first went away before it answered anything."""

import asyncio
import logging

import grpc

from llmmesh.v1 import common_pb2, engine_pb2
from services.dependencies import ENGINE_GONE, Dependencies
from services.disaggregation import remote_prefill
from services.errors import dependency_error
from services.telemetry import SpanKind, Telemetry, inject, set_error

logger = logging.getLogger("llmmesh.gateway")

ENGINE_DONE = object()  # queued by the engine reader after the engine's last message


def engine_request(request, engine_request_id: str, prompt_ids: list[int], lora_name: str):
    """A gateway request as the engine's EngineGenerateRequest."""
    params = common_pb2.SamplingParams()
    params.CopyFrom(request.sampling_params)
    del params.stop[:]  # stop strings are the detokenizer's job
    return engine_pb2.EngineGenerateRequest(
        request_id=engine_request_id,
        prompt_token_ids=prompt_ids,
        sampling_params=params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        lora_name=lora_name,
    )


class EngineCall:
    """One request's engine call. The reader task hands every engine message to on_message as it comes, then queues
    ENGINE_DONE on results, or what ended the call: the engine's status, or any exception at all, so that the
    request fails now rather than wait for its deadline."""

    def __init__(
        self,
        deps: Dependencies,
        telemetry: Telemetry,
        span,
        request_id: str,
        engine_request: engine_pb2.EngineGenerateRequest,
        prompt_ids: list[int],
        results: asyncio.Queue,
        on_message,
    ):
        self.deps, self.telemetry, self.span = deps, telemetry, span
        self.request_id = request_id  # the gateway's, for the log
        self.engine_request, self.prompt_ids = engine_request, prompt_ids
        self.results, self.on_message = results, on_message
        self.address = self.routed = self.call = self.reader = self.context = self.engine_span = None

    def start(self, context) -> None:
        """Open the engine call on the engine the router picks (after the remote prefill, with disaggregated
        prefill) and start the reader. close() undoes as much of this as was done."""
        self.context = context
        if not self.deps.disaggregated():  # else read() calls it after the remote prefill
            self._call_engine()
        context.add_done_callback(lambda _: self.call is not None and self.call.cancel())  # even if never resumed
        self.reader = asyncio.create_task(self.read())

    def _call_engine(self, tried: tuple[str, ...] = ()) -> None:
        """Open the Generate call (and its client span) on the engine the router picks among those not tried."""
        request = self.engine_request
        self.routed = self.deps.route(self.prompt_ids, request.cache_salt, exclude=tried, lora_name=request.lora_name)
        self.address = self.routed.address
        self.engine_span = self.telemetry.start_span(
            "llmmesh.v1.Engine/Generate", self.span, SpanKind.CLIENT, attributes={"server.address": self.address}
        )
        self.call = self.deps.generate(
            self.address,
            request,
            self.context.time_remaining(),  # the client's deadline ends the engine request too
            inject(self.engine_span),
        )

    def _call_another_engine(self, error: grpc.aio.AioRpcError, tried: tuple[str, ...]) -> None:
        """The engine went away before it sent anything (stopping, restarting, unreachable): nothing reached the
        detokenizer or the client yet, so another healthy engine takes the request from the start."""
        logger.info("engine %s: %s; sending %s to another engine", self.address, error.code().name, self.request_id)
        if self.engine_span is not None:
            set_error(self.engine_span, error.code(), error.details() or "")
            self.engine_span.end()
        self.deps.release(self.routed)
        self.routed = None
        self.deps.mark_down(self.address)
        self._call_engine(tried)

    async def read(self) -> None:
        """The reader task. An engine that is UNAVAILABLE before its first message (or CANCELLED, see ENGINE_GONE)
        hands the request to another healthy one."""
        tried = ()
        try:
            if self.deps.disaggregated():
                await remote_prefill(self)
                self._call_engine()
            while True:
                received = False
                try:
                    async for msg in self.call:
                        if not received:
                            received = True
                            self.deps.first_token(self.routed)  # its prefill is done
                        self.on_message(msg)
                    break
                except grpc.aio.AioRpcError as e:
                    tried = (*tried, self.address)
                    if received or e.code() not in ENGINE_GONE or not self.deps.any_healthy_engine(exclude=tried):
                        raise
                    self._call_another_engine(e, tried)
            self.results.put_nowait(ENGINE_DONE)
        except grpc.aio.AioRpcError as e:
            self.results.put_nowait(dependency_error("engine", self.address, e))
        except Exception as e:  # noqa: BLE001 (handed to the request, which ends with it)
            self.results.put_nowait(e)

    def close(self) -> None:
        """End the engine call now, and its span."""
        if self.engine_span is not None:
            self.engine_span.end()
        if self.call is not None:
            self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
        if self.routed is not None:
            self.deps.release(self.routed)
