"""AsyncEngine: one EngineCore stepping in its own thread, fed and read from asyncio.

The asyncio side validates a request, registers its output queue and puts an "add" command in the
inbox; the engine thread drains the inbox (adds and aborts) before every step, steps while there is
work, sleeps on the inbox when there is none, and hands each step's outputs to the event loop in one
call_soon_threadsafe. gRPC handling therefore never waits for a step, and a step never waits for gRPC.

The engine thread also builds the EngineCore, so every torch op runs on that one thread. Each thread
that enters an OpenMP region gets its own pool of workers, and once there are more pooled threads
than cores, libgomp stops spinning between regions: a core loaded on one thread and stepped on
another went from 0.2 to about 180 sleeps of the stepping thread per decode step (measured on 2 cores).
"""

import asyncio
import importlib.metadata
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.core import EngineCore
from engine.output_processor import fan_out
from engine.request import Request, RequestStatus, SamplingParams
from engine.sched.output import EngineCoreOutput
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger("llmmesh.engine_service")


@dataclass
class EngineError:
    """An engine request that failed inside the engine thread; it is gone from the engine."""

    request_id: str
    message: str

    finished = True


@dataclass
class Load:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


_STOP = object()


def llmmesh_version() -> str:
    try:
        return importlib.metadata.version("llmmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class RequestStream:
    """The outputs of one user request (all its n completions), one list per engine step."""

    def __init__(self, request_id: str, requests: list[Request]):
        self.request_id = request_id
        self.requests = requests
        self.index = {r.request_id: i for i, r in enumerate(requests)}
        self.unfinished = set(self.index)
        self.queue: asyncio.Queue[tuple[float, list]] = asyncio.Queue()
        self.closed = False  # the reader went away; outputs are dropped

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[float, list[EngineCoreOutput | EngineError]]:
        """(monotonic time the step ended, this request's outputs in it); stops after the last completion."""
        if not self.unfinished and self.queue.empty():
            raise StopAsyncIteration
        return await self.queue.get()


class AsyncEngine:
    def __init__(self, build_core: Callable[[], EngineCore], tokenizer: Tokenizer | None = None):
        """Start the engine thread, which calls build_core; await loaded() before adding requests."""
        self.core: EngineCore | None = None
        self.tokenizer = tokenizer  # for bad_words; None: requests with bad_words are refused
        self.loop = asyncio.get_running_loop()
        self._loaded: asyncio.Future = self.loop.create_future()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Loop side only: live engine request id -> its stream, and user request id -> stream.
        # An id stays here until its final output (finished, aborted or failed) reaches the loop,
        # so "in use" means the same thing here as in the engine.
        self.streams: dict[str, RequestStream] = {}
        self.requests: dict[str, RequestStream] = {}
        self.load = Load()  # replaced (not mutated) by the engine thread after every step
        self.dead: str | None = None
        # KV cache events (with --enable-kv-cache-events), numbered one batch per step, for subscribers.
        self.kv_event_seq = 0
        self.kv_event_history: deque[tuple[int, float, list]] = deque(maxlen=1024)
        self.kv_event_subscribers: set[asyncio.Queue] = set()
        self._ids = itertools.count()
        self.thread = threading.Thread(target=self._run, args=(build_core,), name="engine-core", daemon=True)
        self.thread.start()

    async def loaded(self) -> EngineCore:
        """The core, once the engine thread has built it; raises what building it raised."""
        return await asyncio.shield(self._loaded)

    # ---- asyncio side ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Validate and queue a request (n engine requests when n > 1); ValueError names what is wrong."""
        if self.dead is not None:
            raise RuntimeError(f"the engine thread has stopped: {self.dead}")
        request_id = request_id or f"req-{next(self._ids)}-{time.monotonic_ns()}"
        keep = params.truncate_prompt_tokens
        if keep is not None:  # keep the end of the prompt, as the offline LLM does
            prompt_token_ids = prompt_token_ids[-(self.core.max_model_len if keep == -1 else keep) :]
        try:
            self.core.validate_prompt(prompt_token_ids)
        except ValueError as e:
            raise ValueError(f"prompt_token_ids: {e}") from None
        self.core.validate_params(params)
        # Each completion is an engine request; more than can ever run at once only piles up memory.
        max_n = self.core.args.max_num_seqs
        if params.n > max_n:
            raise ValueError(f"n must be at most --max-num-seqs={max_n}, got {params.n}.")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the engine's tokenizer, which is not loaded.")
            params.update_from_tokenizer(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        requests = fan_out(request_id, prompt_token_ids, params, arrival_time)
        in_use = [r.request_id for r in requests if r.request_id in self.streams] + (
            [request_id] if request_id in self.requests else []
        )
        if in_use:
            raise ValueError(f"request_id {in_use[0]!r} is already in use by a running request.")
        eos = tuple(self.core.model_config.eos_token_ids)
        for r in requests:
            r.priority, r.cache_salt, r.eos_token_ids = priority, cache_salt or None, eos
        stream = RequestStream(request_id, requests)
        self.requests[request_id] = stream
        for r in requests:
            self.streams[r.request_id] = stream
        self.inbox.put(("add", requests))
        return stream

    def abort(self, request_ids) -> int:
        """Abort user requests (all their completions) or single live engine requests (one child `i_<id>`
        of an n > 1 request, the others going on); what is aborted ends with finish_reason "abort".

        Returns how many of the ids were running."""
        engine_ids, found = [], 0
        for request_id in request_ids:
            stream = self.requests.get(request_id)
            if stream is not None:
                found += 1
                engine_ids.extend(stream.unfinished)
            elif request_id in self.streams:  # an engine request id; add_request keeps the two kinds apart
                found += 1
                engine_ids.append(request_id)
        if engine_ids:
            self.inbox.put(("abort", engine_ids))
        return found

    def abort_engine_requests(self, engine_ids) -> None:
        """Abort single engine requests (e.g. one completion a stop string ended)."""
        self.inbox.put(("abort", list(engine_ids)))

    def close_stream(self, stream: RequestStream) -> None:
        """The reader is gone (cancelled, deadline, error): abort what is unfinished, drop what comes."""
        stream.closed = True
        if stream.unfinished:
            self.inbox.put(("abort", list(stream.unfinished)))

    def _deliver(self, step_end: float, outputs: list, kv_events: list = ()) -> None:
        """On the loop, once per step: each stream gets its outputs of this step as one item."""
        if kv_events:
            self.kv_event_seq += 1
            batch = (self.kv_event_seq, time.time(), kv_events)
            self.kv_event_history.append(batch)
            for subscriber in self.kv_event_subscribers:
                subscriber.put_nowait(batch)
        per_stream: dict[int, tuple[RequestStream, list]] = {}
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self.streams[out.request_id]
                stream.unfinished.discard(out.request_id)
                if not stream.unfinished:
                    self.requests.pop(stream.request_id, None)
            if not stream.closed:
                per_stream.setdefault(id(stream), (stream, []))[1].append(out)
        for stream, outs in per_stream.values():
            stream.queue.put_nowait((step_end, outs))

    def _fail_all(self, message: str) -> None:
        self._deliver(time.monotonic(), [EngineError(engine_id, message) for engine_id in list(self.streams)])

    def shutdown(self, timeout: float = 5.0) -> None:
        self.inbox.put((_STOP, None))
        self.thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------

    def _run(self, build_core: Callable[[], EngineCore]) -> None:
        try:
            self.core = build_core()
        except BaseException as e:
            error = e if isinstance(e, Exception) else RuntimeError(f"loading the engine was interrupted: {e!r}")
            self.dead = f"{type(e).__name__}: {e}"
            self._call_soon(self._loaded.set_exception, error)
            return
        self._call_soon(self._loaded.set_result, self.core)
        try:
            self._serve()
        except BaseException as e:  # a bug outside any one request: fail everyone rather than hang them
            logger.exception("the engine thread died")
            self.dead = f"{type(e).__name__}: {e}"
            self._call_soon(self._fail_all, self.dead)

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
            commands = [self.inbox.get()] if not core.has_unfinished_requests() else []
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            failed = []
            for kind, payload in commands:
                if kind is _STOP:
                    return
                if kind == "add":
                    failed += self._add(payload)
                else:  # "abort": the blocks are free before the next step
                    core.abort_requests(payload)
            outputs = []
            if core.has_unfinished_requests():
                try:
                    outputs = core.step()
                except Exception as e:  # a bug hit by this batch: fail its requests, keep serving
                    logger.exception("engine step failed")
                    outputs = self._fail_running(e)
            sched = core.scheduler
            self.load = Load(len(sched.running), len(sched.waiting), core.kv_cache_manager.usage())
            kv_events = core.take_kv_events()  # always empty without --enable-kv-cache-events
            if (failed or outputs or kv_events) and not self._call_soon(
                self._deliver, time.monotonic(), failed + outputs, kv_events
            ):
                return

    def _add(self, requests: list[Request]) -> list[EngineError]:
        failed = []
        for request in requests:
            try:
                self.core.add_request(request)
            except Exception as e:  # validated already; this is a last line of defence
                logger.warning("request %s refused in the engine thread: %s", request.request_id, e)
                failed.append(EngineError(request.request_id, str(e)))
        return failed

    def _fail_running(self, error: Exception) -> list[EngineError]:
        """After a failed step, the requests it ran get the error and leave; waiting ones go on."""
        # Straight through the scheduler: the error is their final output, not an "abort" one.
        running = [r.request_id for r in self.core.scheduler.running]
        self.core.scheduler.finish_requests(running, RequestStatus.FINISHED_ABORTED)
        message = f"the engine step failed: {type(error).__name__}: {error}"
        return [EngineError(request_id, message) for request_id in running]
