"""AsyncLLM: one EngineCore stepping in its own thread, fed and read from asyncio (vLLM's AsyncLLM).

The asyncio side validates a request, registers it with the OutputProcessor and puts an "add" command
in the inbox; the engine thread drains the inbox (adds and aborts) before every step, steps while
there is work, sleeps on the inbox when there is none, and hands each step's outputs to the event loop
in one call_soon_threadsafe. There the OutputProcessor turns them into one RequestOutput per request
(n completions, stop strings, timings), which goes to that request's stream. gRPC handling never waits
for a step, and a step never waits for gRPC.

The engine thread also builds the EngineCore, so every torch op runs on that one thread. Each thread
that enters an OpenMP region gets its own pool of workers, and once there are more pooled threads
than cores, libgomp stops spinning between regions: a core loaded on one thread and stepped on
another would put its stepping thread to sleep and wake it again many times in every decode step.
"""

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from engine.core import EngineCore
from engine.executor.uniproc import ExecutorDeadError
from engine.info import EngineInfo
from engine.kv.event_publisher import KVEventPublisher
from engine.limits import RequestLimits
from engine.lora.request import LoRARequest
from engine.output_processor import OutputProcessor, RequestOutputKind
from engine.outputs import RequestOutput
from engine.pooling.params import PoolingParams
from engine.processor import Processor
from engine.request import SamplingParams
from engine.sample.sampler import SamplerUnavailableError

logger = logging.getLogger("llmmesh.engine")

_STOP = object()
# Fault injection for the step watchdog's tests: "N:S[,N:S...]" makes the engine's Nth step (counted from 1) sleep
# S seconds before it runs, as a step stuck in a kernel would. Unset, as it is outside tests, it costs nothing.
STUCK_STEP_ENV = "LLMMESH_STUCK_STEP"


class EngineRequestError(Exception):
    """The engine failed this request and it is gone from the engine; the engine goes on serving the others.
    `invalid_input`: the request's own input was at fault; `unavailable`: a service the engine depends on (the
    sampler) is down; neither: the engine failed it (a bug), and the message names the request."""

    def __init__(self, message: str, unavailable: bool = False, invalid_input: bool = False):
        super().__init__(message)
        self.unavailable = unavailable
        self.invalid_input = invalid_input


class EngineDeadError(Exception):
    """The engine thread has stopped (vLLM's EngineDeadError): no request can be served until it is restarted."""


class EngineQueueFullError(Exception):
    """The engine has --max-num-seqs requests running and --max-waiting-requests waiting: it takes no more now."""


class RequestStream:
    """The RequestOutputs of one user request (all its n completions), one per step that moved it."""

    def __init__(self, request_id: str, state):
        self.request_id = request_id
        self.state = state  # the OutputProcessor's RequestState
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):  # EngineRequestError, EngineDeadError
            raise item
        return item


class AsyncLLM:
    def __init__(self, build_core: Callable[[], EngineCore], limits: RequestLimits | None = None):
        """Start the engine thread, which calls build_core; await loaded() before adding requests."""
        self.core: EngineCore | None = None
        self.limits = limits or RequestLimits()
        self.output_processor = OutputProcessor(tokenizer=None)  # set_tokenizer() arms text and bad_words
        self.loop = asyncio.get_running_loop()
        self._loaded: asyncio.Future = self.loop.create_future()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, RequestStream] = {}  # user request id -> its stream, until its last output
        self.processor: Processor | None = None  # admission, once the core is built
        self.stats = None  # the core's SchedulerStats, replaced (not mutated) after every step
        self.info: EngineInfo | None = None  # the core's EngineInfo, once built; replaced when it changes
        self.dead: str | None = None  # why the engine thread stopped
        self.died = asyncio.Event()
        self.kv_events = KVEventPublisher()  # with --enable-kv-cache-events
        # Called on the engine thread after every step with (core.last_step, the step's outputs): metrics and
        # detailed traces. None (the default) costs nothing.
        self.on_step: Callable | None = None
        # Called on the engine thread before every step (detailed traces): returns the step span's
        # traceparent/tracestate, which the step's call to the sampler service carries.
        self.on_step_start: Callable | None = None
        # Telemetry hooks that raised (logged and counted, nothing else: telemetry never fails a request).
        self.hook_errors = 0
        # The step watchdog's view of the engine thread: when its current pass over the inbox and a step began
        # (time.monotonic()), None while it sleeps on an empty inbox; and how many steps it has run.
        self.busy_since: float | None = None
        self.num_steps = 0
        self._stuck_steps = _parse_stuck_steps(os.environ.get(STUCK_STEP_ENV, ""))
        self._ids = itertools.count()
        self.thread = threading.Thread(target=self._run, args=(build_core,), name="engine-core", daemon=True)
        self.thread.start()

    async def loaded(self) -> EngineCore:
        """The core, once the engine thread has built it; raises what building it raised."""
        return await asyncio.shield(self._loaded)

    def set_tokenizer(self, tokenizer) -> None:
        self.output_processor.tokenizer = tokenizer
        if self.processor is not None:
            self.processor.tokenizer = tokenizer

    @property
    def tokenizer(self):
        return self.output_processor.tokenizer

    # ---- asyncio side ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        trace_headers: tuple[tuple[str, str], ...] = (),
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        output_token_ids: list[int] = (),
        mm_features: list | None = None,
    ) -> RequestStream:
        """Check and queue a request (n engine requests when n > 1); ValueError names what is wrong.
        trace_headers: the request span's traceparent/tracestate, for the calls the engine makes for it.
        kv_transfer_params: vLLM's, already checked by the caller, for the KV connector.
        lora_request: an adapter the engine has loaded (add_lora, --lora-modules); None: the base model.
        PoolingParams (a pooling engine's requests): one PoolingRequestOutput once the prompt has run.

        output_token_ids: a request resumed from another engine (n=1), the tokens it generated there; only the
        tokens after them are streamed. mm_features: the prompt's images (MultiModalFeatureSpec), placeholders expanded
        in prompt_token_ids."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine thread has stopped: {self.dead}")
        info = self.info
        if info is not None and len(self.streams) >= info.max_num_seqs + info.max_waiting_requests:
            # Counted in requests in flight (every stream not yet finished), so the bound holds without waiting
            # for the scheduler's figures, which lag a step behind.
            raise EngineQueueFullError(
                f"the engine has {len(self.streams)} requests in flight, --max-num-seqs ({info.max_num_seqs}) "
                f"running and --max-waiting-requests ({info.max_waiting_requests}) waiting; retry later"
            )
        request_id = request_id or f"req-{next(self._ids)}-{time.monotonic_ns()}"
        if isinstance(params, SamplingParams) and params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs the engine's tokenizer, which is not loaded.")
        requests = self.processor.process_inputs(
            request_id,
            prompt_token_ids,
            params,
            arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
            trace_headers=trace_headers,
            kv_transfer_params=kv_transfer_params,
            output_token_ids=output_token_ids,
            mm_features=mm_features,
        )
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")
        first = requests[0]
        sampling = first.sampling_params if first.pooling_params else params  # a pooling request samples nothing
        state = self.output_processor.add_request(
            request_id, None, first.prompt_token_ids, sampling, first.arrival_time, output_kind, requests
        )
        stream = self.streams[request_id] = RequestStream(request_id, state)
        self.inbox.put(("add", requests))
        return stream

    # ---- LoRA adapters: loaded and unloaded on the engine thread, between steps ----------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter (ValueError: what is wrong with it); False if it was loaded already."""
        return await self._on_engine_thread(lambda core: core.add_lora(lora_request))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRARequest:
        """vLLM's load_lora_adapter: add_lora under the next free adapter id, handed out on the engine thread."""

        def load(core: EngineCore) -> LoRARequest:
            lora_request = core.lora_registry.new_request(lora_name, lora_path)
            core.add_lora(lora_request)
            return lora_request

        return await self._on_engine_thread(load)

    async def remove_lora(self, lora_int_id_or_name: int | str) -> bool:
        """Unload an adapter by id or name; False if none such is loaded; ValueError while requests use it."""
        return await self._on_engine_thread(lambda core: core.remove_lora(lora_int_id_or_name))

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.lora_registry.values()}

    @property
    def lora_registry(self) -> dict[str, LoRARequest]:
        """The loaded adapters (--lora-modules' too) by name."""
        return dict(self.core.lora_registry) if self.core is not None else {}

    def lora_request_named(self, lora_name: str) -> LoRARequest | None:
        """A request's adapter by name (None for the base model); LookupError naming the loaded ones when unknown."""
        return self.processor.resolve_lora(lora_name)

    async def _on_engine_thread(self, call: Callable):
        """call(core) on the engine thread between two steps; what it returns or raises."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine thread has stopped: {self.dead}")
        done = self.loop.create_future()
        self.inbox.put(("call", (call, done)))
        return await done

    def subscribe_kv_events(self) -> asyncio.Queue:
        """A queue of (seq, timestamp, events) batches from now on; unsubscribe_kv_events when done."""
        return self.kv_events.subscribe()

    async def subscribe_kv_events_from_snapshot(self) -> asyncio.Queue:
        """subscribe_kv_events, starting with the blocks cached before the first event (batches numbered 0:
        AllBlocksCleared, then BlockStored of their hashes). The engine thread takes the snapshot and has the loop
        start the queue before any later batch, so the stream misses no block and repeats none."""
        subscribed = self.loop.create_future()

        def snapshot(core: EngineCore) -> None:
            batches = KVEventPublisher.snapshot(core.kv_cache_manager)
            self._call_soon(lambda: subscribed.set_result(self.kv_events.subscribe_from(batches)))

        await self._on_engine_thread(snapshot)
        return subscribed.result()

    def unsubscribe_kv_events(self, queue_: asyncio.Queue) -> None:
        self.kv_events.unsubscribe(queue_)

    @property
    def kv_event_drops(self) -> int:
        return self.kv_events.drops

    def call_hook(self, hook: Callable, *args):
        """A telemetry hook: what it raises is logged and counted, and goes no further (None is returned)."""
        try:
            return hook(*args)
        except Exception:
            self.hook_errors += 1
            logger.exception("a telemetry hook (%s) raised; ignored", getattr(hook, "__qualname__", hook))
            return None

    def abort(self, request_ids, stop_string: bool = False) -> int:
        """Abort user requests (all their completions) or single engine requests (one child `i_<id>` of an
        n > 1 request, the others going on); what is aborted ends with finish_reason "abort" on its stream, or
        "stop" when the caller found a stop string (a request whose completions are all finished then ends its
        stream normally). Returns how many of the ids were running."""
        engine_ids, found = [], 0
        for request_id in request_ids:
            stream = self.streams.get(request_id)
            if stream is not None:
                engine_ids += stream.state.unfinished_engine_ids()
                found += 1
            elif request_id in self.output_processor.parent_of:
                engine_ids.append(request_id)
                found += 1
        if stop_string:
            self._finish_at_stop_string(engine_ids)
        if engine_ids:
            self.inbox.put(("abort", engine_ids))
        return found

    def _finish_at_stop_string(self, engine_ids: list[str]) -> None:
        """The caller's stop strings ended these engine requests: they finish "stop" here and now, and a request
        left with nothing unfinished hands out its last output (the engine's late outputs for them are dropped)."""
        touched = {}
        for engine_id in engine_ids:
            state = self.output_processor.parent_of.pop(engine_id, None)
            if state is not None:
                state.stop_at_string(state.by_engine_id[engine_id], None, engine_finished=True)
                touched[state.request_id] = state
        for state in touched.values():
            if not state.finished:
                continue
            self.output_processor.request_states.pop(state.request_id, None)
            stream, output = self.streams.pop(state.request_id, None), state.output()
            if stream is not None and output is not None:
                stream.finished = True
                stream.queue.put_nowait(output)

    def close_stream(self, stream: RequestStream) -> None:
        """The reader is gone (done, cancelled, deadline, error): forget the request and abort what is unfinished."""
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]
        engine_ids = self.output_processor.abort_requests([stream.request_id])
        if engine_ids:
            self.inbox.put(("abort", engine_ids))

    def _deliver(self, step_end: float, outputs: list, failed: dict[str, str], kv_events: list) -> None:
        """On the loop, once per step: each request's stream gets one RequestOutput."""
        if kv_events:
            self.kv_events.publish(kv_events)
        for engine_id, error in failed.items():
            state = self.output_processor.parent_of.get(engine_id)
            if state is not None:
                self._fail(self.streams.get(state.request_id), state.request_id, error)
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(outputs, step_end)
        if reqs_to_abort:  # stop strings: free their blocks before the next step
            self.inbox.put(("abort", reqs_to_abort))
        for output in request_outputs:
            stream = self.streams.get(output.request_id)
            if stream is None:
                continue
            if output.error is not None:  # it failed on its own: its stream raises, its batch mates go on
                error = output.error
                self._fail(
                    stream, output.request_id, EngineRequestError(error.message, invalid_input=error.invalid_input)
                )
                continue
            stream.queue.put_nowait(output)
            if output.finished:
                stream.finished = True
                del self.streams[output.request_id]

    def _fail(
        self, stream: RequestStream | None, request_id: str, error: "EngineRequestError | EngineDeadError | str"
    ) -> None:
        """End a request with an error: its other completions are aborted, its stream raises."""
        engine_ids = self.output_processor.abort_requests([request_id])
        if engine_ids:
            self.inbox.put(("abort", engine_ids))
        if stream is not None:
            stream.finished = True
            stream.queue.put_nowait(error if isinstance(error, Exception) else EngineRequestError(error))
            self.streams.pop(request_id, None)

    def _fail_all(self, message: str) -> None:
        self.died.set()
        for request_id, stream in list(self.streams.items()):
            self._fail(stream, request_id, EngineDeadError(message))

    def fail_requests(self, message: str) -> int:
        """End every running request now with an EngineRequestError(unavailable=True) saying `message` (the engine
        is stopping, or its step is stuck), so that its caller can send it elsewhere; the engine goes on. Returns
        how many there were."""
        streams = list(self.streams.items())
        for request_id, stream in streams:
            self._fail(stream, request_id, EngineRequestError(message, unavailable=True))
        return len(streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.inbox.put((_STOP, None))
        self.thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------

    def _run(self, build_core: Callable[[], EngineCore]) -> None:
        try:
            self.core = build_core()
            # A tensor-parallel rank that goes while the engine is idle wakes the thread, which then ends.
            self.core.executor.on_failure = lambda reason: self.inbox.put(("executor_dead", reason))
            self.processor = Processor.for_engine(self.core, self.limits, self.tokenizer)
            self.stats = self.core.get_stats()
            self.info = self.core.info
        except BaseException as e:  # noqa: BLE001 (loading failed or was interrupted: the caller of loaded() gets it)
            error = e if isinstance(e, Exception) else RuntimeError(f"loading the engine was interrupted: {e!r}")
            self.dead = f"{type(e).__name__}: {e}"
            self._call_soon(self._loaded.set_exception, error)
            return
        self._call_soon(self._loaded.set_result, self.core)
        try:
            self._serve()
        except BaseException as e:  # a bug outside any one request: fail everyone rather than hang them
            logger.exception("the engine thread died")
            self.dead = f"the engine thread died: {type(e).__name__}: {e}"
            self._call_soon(self._fail_all, self.dead)
        finally:
            self.core.shutdown()

    def _call(self, core: EngineCore, call: Callable, done: asyncio.Future) -> None:
        """On the engine thread: run call(core) and settle `done` on the loop with its result or error."""
        result = error = None
        try:
            result = call(core)
        except Exception as e:  # noqa: BLE001 (the caller gets it: a bad adapter never stops the engine)
            error = e
        self.info = core.update_info()  # what the call changed (an adapter) shows before its caller goes on
        self._call_soon(_settle, done, result, error)

    def _call_soon(self, callback, *args) -> bool:
        """Run callback on the event loop; False when the loop is closed and nobody listens any more."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            return False
        return True

    def _serve(self) -> None:
        core = self.core
        while True:
            # Sleep on the inbox only when there is nothing to step.
            commands = []
            if not core.has_unfinished_requests():
                self.busy_since = None  # asleep, not stuck
                commands.append(self.inbox.get())
            self.busy_since = time.monotonic()
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            failed: dict[str, EngineRequestError | str] = {}
            for kind, payload in commands:
                if kind is _STOP:
                    return
                if kind == "executor_dead":
                    raise ExecutorDeadError(payload)
                if kind == "add":
                    for request in payload:
                        try:
                            core.add_request(request)
                        except Exception as e:  # noqa: BLE001 (checked already; this is a last line of defence)
                            logger.warning("request %s refused in the engine thread: %s", request.request_id, e)
                            failed[request.request_id] = str(e)
                elif kind == "call":
                    self._call(core, *payload)
                else:  # "abort": the blocks are free before the next step
                    core.abort_requests(payload)
            outputs = []
            if core.has_unfinished_requests():
                if self.on_step_start is not None:
                    core.set_step_trace_headers(self.call_hook(self.on_step_start) or ())
                self.num_steps += 1
                if self.num_steps in self._stuck_steps:
                    logger.warning(
                        "step %d sleeps %g s (%s)", self.num_steps, self._stuck_steps[self.num_steps], STUCK_STEP_ENV
                    )
                    time.sleep(self._stuck_steps[self.num_steps])
                try:
                    outputs = core.step()
                except SamplerUnavailableError as e:  # the sampler service is down: fail the batch, keep serving
                    logger.warning("engine step failed: %s", e)
                    error = EngineRequestError(f"sampling failed: {e}", unavailable=True)
                    failed.update(dict.fromkeys(core.fail_running_requests(), error))
                    failed.update(dict.fromkeys(core.fail_requests(e.lost_request_ids), error))
                except ExecutorDeadError:  # a rank is gone: no step can run again
                    raise
                except Exception as e:  # a bug hit by this batch: fail its requests, keep serving
                    logger.exception("engine step failed")
                    message = f"the engine step failed: {type(e).__name__}: {e}"
                    failed.update(dict.fromkeys(core.fail_running_requests(), message))
                else:
                    if self.on_step is not None:
                        self.call_hook(self.on_step, core.last_step, outputs)
            self.stats = core.get_stats()
            self.info = core.update_info()
            kv_events = core.take_kv_events()  # always empty without --enable-kv-cache-events
            if (failed or outputs or kv_events) and not self._call_soon(
                self._deliver, time.monotonic(), outputs, failed, kv_events
            ):
                return


def _parse_stuck_steps(value: str) -> dict[int, float]:
    """STUCK_STEP_ENV's value as step -> seconds."""
    entries = [entry.partition(":") for entry in value.split(",") if entry]
    return {int(step): float(seconds) for step, _, seconds in entries}


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if not future.done():  # its caller may have been cancelled
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
