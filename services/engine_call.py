"""The gateway's Generate call to an engine for one request: routed, opened, read by a task of its own, and sent
to another engine when the first went away, before it answered anything or mid-stream.

A request whose engine goes away mid-stream (the process died, the connection reset, or UNAVAILABLE or CANCELLED
from an engine that is stopping) migrates: each unfinished completion goes on as a request of its own (n=1) on
another healthy engine (one with its LoRA adapter), with the tokens the gateway received so far as its
output_token_ids. The engine counts them as the request's output: max_tokens, min_tokens, penalties, the
grammar (replayed over them) and the seeded draws (keyed by seed and token index) continue where they stood, and
it loads what the KV store holds of their blocks. Only the tokens after them come back, so the client's stream
goes on with no token missing or repeated. A request moves at most --migration-limit times. A stream on an engine
that has failed its health checks for --step-timeout seconds (a stopped process, which cannot end it) is broken by
the gateway's health watch (Dependencies) and migrates the same way.
"""

import asyncio
import logging
import uuid

import grpc

from llmmesh.v1 import common_pb2, engine_pb2
from services.dependencies import ENGINE_GONE, HEALTH_INTERVAL, Dependencies
from services.disaggregation import remote_prefill
from services.errors import dependency_error, unavailable
from services.telemetry import SpanKind, Telemetry, inject, set_error

logger = logging.getLogger("llmmesh.gateway")

ENGINE_DONE = object()  # queued by the engine reader after the engine's last message
# How many health checks a migration waits for another engine to be seen healthy before it fails the request.
MIGRATION_WAIT_CHECKS = 4


def engine_request(request, engine_request_id: str, prompt_ids: list[int], lora_name: str, mm_inputs=()):
    """A gateway request as the engine's EngineGenerateRequest (mm_inputs: its images, as the tokenizer made them)."""
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
        mm_inputs=mm_inputs,
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
        is_finished=lambda index: False,
        migration_limit: int = 0,
        counters: dict | None = None,
    ):
        self.deps, self.telemetry, self.span = deps, telemetry, span
        self.request_id = request_id  # the gateway's, for the log
        self.engine_request, self.prompt_ids = engine_request, prompt_ids
        self.results, self.on_message = results, on_message
        self.address = self.routed = self.call = self.reader = self.context = self.engine_span = None
        # Migration: the tokens each completion received so far, those the engine finished, whether the gateway
        # finished one (a stop string), the moves made and allowed, and where each moved completion runs now.
        n = max(engine_request.sampling_params.n, 1)
        self.received: list[list[int]] = [[] for _ in range(n)]
        self.finished: set[int] = set()
        self.is_finished = is_finished
        self.num_migrations, self.migration_limit = 0, migration_limit
        self.counters = counters if counters is not None else {}
        self.moved: dict[int, tuple[str, str]] = {}  # completion index -> (engine address, engine request id)
        self.resumed_calls: dict[int, tuple] = {}  # completion index -> (call, routed, span) while it runs
        self.broken: dict[str, grpc.aio.AioRpcError] = {}  # engine address -> why the health watch broke its calls

    def start(self, context) -> None:
        """Open the engine call on the engine the router picks (after the remote prefill, with disaggregated
        prefill) and start the reader. close() undoes as much of this as was done."""
        self.context = context
        if not self.deps.disaggregated():  # else read() calls it after the remote prefill
            self._call_engine()
        context.add_done_callback(lambda _: self.call is not None and self.call.cancel())  # even if never resumed
        self.deps.watch(self)
        self.reader = asyncio.create_task(self.read())

    def _call_engine(self, tried: tuple[str, ...] = ()) -> None:
        """Open the Generate call (and its client span) on the engine the router picks among those not tried."""
        request = self.engine_request
        self.routed = self.deps.route(
            self.prompt_ids,
            request.cache_salt,
            exclude=tried,
            lora_name=request.lora_name,
            mm_features=request.mm_inputs,
        )
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

    def _receive(self, msg: engine_pb2.EngineGenerateResponse, index: int | None = None) -> None:
        """An engine message, noted for migration and handed on; index: the completion a resumed call runs (its
        engine numbers it 0)."""
        for d in msg.outputs:
            if index is not None:
                d.index = index
            if 0 <= d.index < len(self.received):
                self.received[d.index].extend(d.token_ids)
                if d.finish_reason:
                    self.finished.add(d.index)
        self.on_message(msg)

    async def read(self) -> None:
        """The reader task. An engine that is UNAVAILABLE before its first message (or CANCELLED, see ENGINE_GONE)
        hands the request to another healthy one; one that goes away after it, migrates the request."""
        tried = ()
        try:
            if self.deps.disaggregated():
                await remote_prefill(self)
                self._call_engine()
            while True:
                received = False
                try:
                    async for msg in self._messages(self.call, self.address):
                        if not received:
                            received = True
                            self.deps.first_token(self.routed)  # its prefill is done
                        self._receive(msg)
                    break
                except grpc.aio.AioRpcError as e:
                    tried = (*tried, self.address)
                    if e.code() not in ENGINE_GONE:
                        raise
                    if received:
                        await self._migrate(e)
                        break
                    if not self.deps.any_healthy_engine(exclude=tried):
                        raise
                    self._call_another_engine(e, tried)
            self.results.put_nowait(ENGINE_DONE)
        except grpc.aio.AioRpcError as e:
            self.results.put_nowait(dependency_error("engine", self.address, e))
        except Exception as e:  # noqa: BLE001 (handed to the request, which ends with it)
            self.results.put_nowait(e)

    # ---- migration ---------------------------------------------------------------------------------

    def _count_migration(self, address: str, error: grpc.aio.AioRpcError) -> None:
        """One more move of this request; UNAVAILABLE naming the limit past it."""
        self.num_migrations += 1
        if self.num_migrations > self.migration_limit:
            raise unavailable(
                f"the engine at {address} went away ({error.code().name}: {error.details() or ''}) and the request "
                f"already moved {self.migration_limit} times, its limit (--migration-limit={self.migration_limit})"
            )
        self.counters["request_migrations"] = self.counters.get("request_migrations", 0) + 1

    async def _migrate(self, error: grpc.aio.AioRpcError) -> None:
        """The engine of the whole request went away mid-stream: each unfinished completion resumes elsewhere. With
        no other engine healthy, the request fails with the engine's error."""
        gone = self.address
        # An engine restarting beside it may answer SERVING before the next health check sees it: wait for that.
        for _ in range(MIGRATION_WAIT_CHECKS):
            if self.deps.any_healthy_engine(exclude=(gone,)):
                break
            await asyncio.sleep(HEALTH_INTERVAL)
        else:
            raise error
        if self.engine_span is not None:
            set_error(self.engine_span, error.code(), error.details() or "")
            self.engine_span.end()
            self.engine_span = None
        self.deps.release(self.routed)
        self.routed, self.call = None, None
        self.deps.mark_down(gone)
        self._count_migration(gone, error)
        pending = [i for i in range(len(self.received)) if i not in self.finished and not self.is_finished(i)]
        await asyncio.gather(*(self._resume(i, (gone,)) for i in pending))

    def _resumed_request(self, index: int) -> engine_pb2.EngineGenerateRequest:
        """Completion `index` as a request of its own, with its output so far."""
        request = engine_pb2.EngineGenerateRequest()
        request.CopyFrom(self.engine_request)
        request.request_id = uuid.uuid4().hex  # unique on every engine
        request.ClearField("kv_transfer_params")
        params = request.sampling_params
        params.ClearField("prompt_logprobs")  # sent already, with the first tokens
        if params.n > 1 and params.HasField("seed"):
            params.seed += index  # the seed the engine gave this completion (engine/processor.py's fan_out)
        params.n = 1
        request.output_token_ids[:] = self.received[index]
        return request

    async def _resume(self, index: int, tried: tuple[str, ...]) -> None:
        """Run completion `index` to its end on another engine, moving it again if that one goes away too."""
        gone = tried[-1]
        while True:
            request = self._resumed_request(index)
            routed = self.deps.route(
                self.prompt_ids,
                request.cache_salt,
                exclude=tried,
                lora_name=request.lora_name,
                mm_features=request.mm_inputs,
            )
            address = routed.address
            logger.info(
                "engine %s went away: %s completion %d resumes on %s after %d tokens",
                gone,
                self.request_id,
                index,
                address,
                len(self.received[index]),
            )
            if self.span is not None:
                self.span.add_event(
                    "migration",
                    {
                        "llmmesh.migration.from": gone,
                        "llmmesh.migration.to": address,
                        "llmmesh.migration.count": self.num_migrations,
                        "gen_ai.response.choice.index": index,
                        "llmmesh.migration.tokens": len(self.received[index]),
                    },
                )
            span = self.telemetry.start_span(
                "llmmesh.v1.Engine/Generate", self.span, SpanKind.CLIENT, attributes={"server.address": address}
            )
            call = self.deps.generate(address, request, self.context.time_remaining(), inject(span))
            self.resumed_calls[index] = (call, routed, span)
            self.moved[index] = (address, request.request_id)
            try:
                first = True
                async for msg in self._messages(call, address):
                    if first:
                        first = False
                        self.deps.first_token(routed)
                    self._receive(msg, index)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() not in ENGINE_GONE:
                    raise
                if span is not None:
                    set_error(span, e.code(), e.details() or "")
                self.deps.mark_down(address)
                tried, gone = (*tried, address), address
                if index in self.finished or self.is_finished(index):
                    return
                if not self.deps.any_healthy_engine(exclude=tried):
                    raise dependency_error("engine", address, e) from None
                self._count_migration(address, e)
            finally:
                self.resumed_calls.pop(index, None)
                if span is not None:
                    span.end()
                self.deps.release(routed)

    # ---- an engine that fails its health checks ---------------------------------------------------------------

    def break_engine(self, address: str, reason: str) -> None:
        """The engine at address has failed its health checks past --step-timeout: this request's calls there end
        as if it went away (UNAVAILABLE: reason), and so move to another engine."""
        calls = [(self.call, self.address)] + [(c, routed.address) for c, routed, _ in self.resumed_calls.values()]
        for call, at in calls:
            if call is not None and at == address and not call.done():
                self.broken[address] = grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=reason
                )
                call.cancel()

    async def _messages(self, call, address: str):
        """The call's messages. A call broken by break_engine raises its UNAVAILABLE, where gRPC raises
        CancelledError for a call cancelled here; a cancel of the request itself stays one."""
        try:
            async for msg in call:
                yield msg
        except asyncio.CancelledError:
            error = self.broken.get(address)
            if error is None or asyncio.current_task().cancelling():
                raise
            raise error from None

    def where(self, index: int, engine_request_id: str) -> tuple[str, str]:
        """The engine and engine request id that run completion `index` now (engine_request_id: its first)."""
        return self.moved.get(index, (self.address, engine_request_id))

    def close(self) -> None:
        """End the engine call now (every call of a migrated request), and its span."""
        self.deps.unwatch(self)
        if self.engine_span is not None:
            self.engine_span.end()
        if self.call is not None:
            self.call.cancel()
        for call, _, _ in list(self.resumed_calls.values()):
            call.cancel()
        if self.reader is not None:
            self.reader.cancel()
        if self.routed is not None:
            self.deps.release(self.routed)
