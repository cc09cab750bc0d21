"""The engine service: `llmmesh.v1.Engine` and vLLM's `VllmEngine` on one port, thin adapters over AsyncLLM."""

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time

import grpc

from engine.async_llm import AsyncLLM
from engine.config import EngineArgs
from engine.config.lora import runtime_lora_path
from engine.core import EngineCore
from engine.kv.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from engine.pooling.params import PoolingParams
from engine.text.tokenizer import Tokenizer
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from mesh import tls
from services import config
from services.convert import mm_features_from_llmmesh, request_output_to_llmmesh, sampling_params_from_llmmesh
from services.engine_telemetry import EngineTelemetry
from services.generate import images_named, refuse_generate_on_pooling, serve_embedding, serve_request
from services.kv_transfer_params import REMOTE_PREFILL_PARAMS, parse_kv_transfer_params
from services.server import Server, llmmesh_version
from services.settings import check_step_timeouts
from services.vllm_engine import VLLM_ENGINE_SERVICE, VllmEngineServicer, vllm_engine_pb2_grpc

logger = logging.getLogger("llmmesh.engine")

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
MAX_LORA_PATH_CHARS = 4096  # PATH_MAX
# The end of the drain: requests still running this long before --shutdown-timeout expires end UNAVAILABLE, which
# reaches the gateway (and moves them to another engine) before gRPC would cancel their calls.
HANDOVER_S = 1.0
WATCHDOG_POLL_S = 0.25  # how often the step watchdog looks at the engine thread


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """llmmesh.v1.Engine. `engine` is None until the model is loaded; RPCs then get UNAVAILABLE."""

    def __init__(self, engine: AsyncLLM | None = None):
        self.engine = engine
        self.observer: EngineTelemetry | None = None  # metrics and request spans, when either is on
        self.stopping = asyncio.Event()  # the server's stop_requested: KV event streams end, not hold its drain
        self.lora_lock = asyncio.Lock()  # one LoadLoraAdapter at a time: a name and an id are taken once
        # --allow-runtime-lora-updating's --lora-root: LoadLoraAdapter and UnloadLoraAdapter are refused without it.
        self.lora_root: str | None = None
        self.stuck: str | None = None  # the step watchdog's finding while the engine's step is stuck

    async def ready(self, context) -> AsyncLLM:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model; retry shortly")
        if self.engine.dead is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.dead)
        if self.stuck is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.stuck)
        return self.engine

    async def Generate(self, request: engine_pb2.EngineGenerateRequest, context):
        engine = await self.ready(context)
        refusal = refuse_generate_on_pooling(engine)
        if refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        try:
            kv_transfer = parse_kv_transfer_params(request.kv_transfer_params, engine.info.kv_role)
            engine.limits.check_chars("lora_name", request.lora_name, "max_id_chars")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            lora_request = engine.lora_request_named(request.lora_name)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))

        def add_request(arrival, trace_headers):
            params = sampling_params_from_llmmesh(request.sampling_params)
            params.detokenize = bool(params.stop)  # token ids travel; text only to find stop strings
            with images_named("mm_inputs"):
                return engine.add_request(
                    request.request_id,
                    list(request.prompt_token_ids),
                    params,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    arrival_time=arrival,
                    trace_headers=trace_headers,
                    kv_transfer_params=kv_transfer,
                    lora_request=lora_request,
                    output_token_ids=list(request.output_token_ids),
                    mm_features=mm_features_from_llmmesh(request.mm_inputs),
                )

        first_tokens = True
        async with contextlib.aclosing(
            serve_request(engine, self.observer, context, request.request_id, add_request, request.lora_name)
        ) as outputs:
            async for out in outputs:
                moved = any(c.token_ids for c in out.outputs)
                msg = request_output_to_llmmesh(out, first_tokens and moved)
                if out.finished and kv_transfer.get("do_remote_decode"):
                    # A kv_producer's steps answer once their blocks are stored: they are in the kvstore now.
                    msg.kv_transfer_params = REMOTE_PREFILL_PARAMS
                yield msg
                first_tokens = first_tokens and not moved

    async def Embed(self, request: engine_pb2.EngineEmbedRequest, context):
        engine = await self.ready(context)
        params = PoolingParams(normalize=request.normalize if request.HasField("normalize") else None)
        prompt_ids = list(request.prompt_token_ids)
        out = await serve_embedding(
            engine, self.observer, context, request.request_id, prompt_ids, params, request.priority, request.cache_salt
        )
        return engine_pb2.EngineEmbedResponse(
            embedding=out.outputs.data.tolist(),
            num_prompt_tokens=len(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
        )

    async def Abort(self, request: engine_pb2.AbortRequest, context):
        engine = await self.ready(context)
        return engine_pb2.AbortResponse(num_aborted=engine.abort(request.request_ids, request.stop_string))

    async def GetModelInfo(self, request, context):
        info = (await self.ready(context)).info
        return engine_pb2.ModelInfo(
            model=info.model,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            dtype=info.dtype,
            eos_token_ids=info.eos_token_ids,
            block_size=info.block_size,
            enable_prefix_caching=info.enable_prefix_caching,
            prefix_caching_hash_algo=info.prefix_caching_hash_algo,
            prefix_caching_hash_seed=info.prefix_caching_hash_seed or "",
            enable_kv_cache_events=info.enable_kv_cache_events,
            enable_lora=info.enable_lora,
            max_loras=info.max_loras,
            max_lora_rank=info.max_lora_rank,
            runner_type=info.runner_type,
        )

    async def GetServerInfo(self, request, context):
        info = (await self.ready(context)).info
        return engine_pb2.ServerInfo(
            version=llmmesh_version(),
            block_size=info.block_size,
            num_gpu_blocks=info.num_blocks,
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_logprobs=info.max_logprobs,
            device=info.device,
        )

    async def GetLoad(self, request, context):
        engine = await self.ready(context)
        stats = engine.stats
        load = engine_pb2.Load(
            num_running=stats.num_running_reqs, num_waiting=stats.num_waiting_reqs, kv_cache_usage=stats.kv_cache_usage
        )
        connector_stats = engine.info.kv_connector_stats
        if connector_stats is not None and connector_stats.block_load_cost is not None:
            load.kv_load_cost = connector_stats.block_load_cost
        return load

    async def SubscribeKvEvents(self, request, context):
        engine = await self.ready(context)
        if not engine.info.enable_kv_cache_events:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "KV cache events are off; start the engine with --enable-kv-cache-events",
            )
        # The blocks cached already come first, so the subscriber's index is right from the start (or a reconnect).
        queue = await engine.subscribe_kv_events_from_snapshot()  # bounded: one that falls behind loses the oldest
        await context.send_initial_metadata(())  # the stream is open before the first event
        stopping = batch = asyncio.ensure_future(self.stopping.wait())
        try:
            while True:
                batch = asyncio.ensure_future(queue.get())
                await asyncio.wait((batch, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not batch.done():
                    return
                yield kv_events_to_llmmesh(*batch.result())
        finally:  # the server stops, or the subscriber went away
            stopping.cancel()
            batch.cancel()
            engine.unsubscribe_kv_events(queue)

    # ---- LoRA adapters (vLLM's load_lora_adapter / unload_lora_adapter) ----------------------------

    async def _lora_engine(self, context) -> AsyncLLM:
        engine = await self.ready(context)
        if not engine.info.enable_lora:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "LoRA adapters are off; start the engine with --enable-lora"
            )
        if self.lora_root is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "loading and unloading LoRA adapters at run time is off; start the engine with "
                "--allow-runtime-lora-updating and --lora-root",
            )
        return engine

    async def LoadLoraAdapter(self, request: common_pb2.LoadLoraAdapterRequest, context):
        engine = await self._lora_engine(context)
        name, path = request.lora_name, request.lora_path
        try:
            if not name or not path:
                raise ValueError("lora_name and lora_path are both required.")
            engine.limits.check_chars("lora_name", name, "max_id_chars")
            if len(path) > MAX_LORA_PATH_CHARS:
                raise ValueError(f"lora_path: at most {MAX_LORA_PATH_CHARS} characters, got {len(path)}.")
            if "\0" in path:
                raise ValueError("lora_path: holds a NUL character.")
            path = runtime_lora_path(self.lora_root, path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async with self.lora_lock:
            if name in engine.lora_registry:
                await context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"lora_name {name!r}: an adapter of that name is loaded"
                )
            try:
                lora = await engine.load_lora_adapter(name, path)
            except ValueError as e:  # a bad adapter: the message names what is wrong with it, and no path
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {e}")
        logger.info("LoRA adapter %s loaded from %s (id %d)", name, path, lora.lora_int_id)
        return common_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(self, request: common_pb2.UnloadLoraAdapterRequest, context):
        engine = await self._lora_engine(context)
        try:
            lora = engine.lora_request_named(request.lora_name)
            if lora is None:
                raise ValueError("lora_name is required.")
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            await engine.remove_lora(lora.lora_name)
        except ValueError as e:  # requests in flight use it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"lora_name {lora.lora_name!r}: {e}")
        logger.info("LoRA adapter %s unloaded", lora.lora_name)
        return common_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request, context):
        info = (await self.ready(context)).info
        return engine_pb2.ListLoraAdaptersResponse(
            adapters=[
                engine_pb2.LoraAdapter(
                    lora_name=a.lora_name,
                    lora_path=a.lora_path,
                    lora_int_id=a.lora_int_id,
                    digest=info.lora_digests.get(a.lora_int_id, b""),
                )
                for a in info.lora_adapters.values()
            ]
        )


def kv_events_to_llmmesh(seq: int, timestamp: float, events: list) -> engine_pb2.KvEventBatch:
    batch = engine_pb2.KvEventBatch(sequence_number=seq, timestamp=timestamp)
    for event in events:
        if isinstance(event, BlockStored):
            stored = engine_pb2.BlockStored(
                block_hashes=event.block_hashes,
                parent_block_hash=event.parent_block_hash or b"",
                block_size=event.block_size,
                medium=event.medium,
                loaded_from=event.loaded_from or "",
                group_id=event.group_id,
            )
            batch.events.add(stored=stored)
        elif isinstance(event, BlockRemoved):
            batch.events.add(removed=engine_pb2.BlockRemoved(block_hashes=event.block_hashes, group_id=event.group_id))
        elif isinstance(event, AllBlocksCleared):
            batch.events.add(cleared=engine_pb2.AllBlocksCleared())
    return batch


# ---- the process -----------------------------------------------------------------


def lora_vllm_ports(args, flag: str = "lora_vllm_ports") -> dict[str, int]:
    """--lora-vllm-ports (or the flag named) as adapter name -> port; ValueError naming what is wrong."""
    ports: dict[str, int] = {}
    for entry in getattr(args, flag) or []:
        name, _, port = entry.partition("=")
        if not name or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{flag} entries must be NAME=PORT with PORT in [1, 65535], got {entry!r}.")
        if name in ports or int(port) in ports.values() or int(port) == args.port:
            raise ValueError(f"{flag}: each name and port once, and not --port, got {entry!r} again.")
        ports[name] = int(port)
    if ports and not args.enable_lora:
        raise ValueError(f"{flag} needs enable_lora (--enable-lora).")
    return ports


class StepWatchdog:
    """The engine thread watched from a thread of its own, so that health tells whether the engine steps, not only
    whether its gRPC server answers. A stuck kernel, a collective that never completes and a stopped tensor-parallel
    rank all look alike from here: a pass of the engine loop (its inbox and one step) that does not end.

    Past step_timeout s, on_stuck(seconds) runs on the event loop (health NOT_SERVING, requests sent elsewhere), and
    on_unstuck(seconds) if the step then ends. Past exit_timeout s the process exits with code 1 at once, from this
    thread (the engine thread cannot be joined), to be restarted. A limit of 0 is off."""

    def __init__(self, engine: AsyncLLM, step_timeout: float, exit_timeout: float, on_stuck, on_unstuck):
        self.engine = engine
        self.step_timeout, self.exit_timeout = step_timeout, exit_timeout
        self.on_stuck, self.on_unstuck = on_stuck, on_unstuck
        self.stuck = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)

    def start(self) -> None:
        if self.step_timeout or self.exit_timeout:
            self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(WATCHDOG_POLL_S):
            since = self.engine.busy_since
            busy = 0.0 if since is None else time.monotonic() - since
            if self.exit_timeout and busy >= self.exit_timeout:
                logger.critical(
                    "the engine's step has run for %.0f s, past --step-timeout-exit (%g s): exiting with code 1",
                    busy,
                    self.exit_timeout,
                )
                logging.shutdown()  # flush the log: nothing else runs after this
                os._exit(1)
            stuck = bool(self.step_timeout) and busy >= self.step_timeout
            if stuck != self.stuck:
                self.stuck = stuck
                self.engine.loop.call_soon_threadsafe(self.on_stuck if stuck else self.on_unstuck, busy)


async def hand_over_at_drain_end(engine: AsyncLLM, stop_requested: asyncio.Event, shutdown_timeout: float) -> None:
    """Once the drain is about to end, the requests still running end UNAVAILABLE saying the engine is stopping,
    which the gateway answers by moving them to another engine: a drained engine loses no stream. gRPC itself
    would cancel their calls, and CANCELLED reaches a client that called the engine directly as an error."""
    await stop_requested.wait()
    await asyncio.sleep(max(0.0, shutdown_timeout - min(HANDOVER_S, shutdown_timeout / 2)))
    ended = engine.fail_requests(f"the engine is stopping: its --shutdown-timeout ({shutdown_timeout:g} s) is over")
    if ended:
        logger.warning("%d requests still running at the end of the drain end UNAVAILABLE", ended)


async def serve(args) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    adapter_ports = lora_vllm_ports(args)
    check_step_timeouts(args.step_timeout, args.step_timeout_exit)
    plaintext_adapter_ports = lora_vllm_ports(args, "lora_vllm_plaintext_ports")
    # Both protocols on one port, over one AsyncLLM; each of --lora-vllm-ports' adapters on VllmEngine at its own.
    server = Server("engine", [ENGINE_SERVICE, VLLM_ENGINE_SERVICE], args)
    servicer = EngineServicer()
    servicer.stopping = server.stop_requested
    if engine_args.allow_runtime_lora_updating:
        servicer.lora_root = engine_args.lora_root
    server.add(engine_pb2_grpc.add_EngineServicer_to_server, servicer)
    server.add(vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, VllmEngineServicer(servicer))
    adapter_servers = []

    def serve_vllm(port: int, lora_name: str = "", **transport) -> None:
        adapter_servers.append(server.sibling([VLLM_ENGINE_SERVICE], port, **transport))
        adapter_servers[-1].add(
            vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, VllmEngineServicer(servicer, lora_name)
        )

    for name, port in adapter_ports.items():
        serve_vllm(port, name)
    # smg reaches its workers in plaintext only (it sends no TLS to a grpcs:// worker): vLLM's protocol for it on
    # loopback ports, which only processes of this host reach.
    plaintext = dict(host="127.0.0.1", insecure_plaintext=True)
    if args.vllm_plaintext_port is not None:
        serve_vllm(args.vllm_plaintext_port, **plaintext)
    for name, port in plaintext_adapter_ports.items():
        serve_vllm(port, name, **plaintext)
    servers = (server, *adapter_servers)
    for s in servers:
        await s.start()  # health answers NOT_SERVING while the model loads
    # The engine's plug-ins (the KV connector, the remote sampler) present its credentials: they read them here.
    os.environ[tls.TLS_DIR_ENV] = args.tls_dir or tls.default_tls_dir()
    os.environ[tls.PLAINTEXT_ENV] = "1" if args.insecure_plaintext else ""
    engine = AsyncLLM(lambda: EngineCore(engine_args), config.limits_from_args(args))
    try:
        await engine.loaded()
        engine.set_tokenizer(await asyncio.to_thread(Tokenizer.from_pretrained, engine.info.model_dir))
    except BaseException:
        engine.shutdown(timeout=0)
        for s in (*adapter_servers, server):
            await s.stop(0)
        raise
    observer = EngineTelemetry(server.telemetry, servicer, args.model, args.collect_detailed_traces)
    if observer.active:
        servicer.observer = observer
        observer.attach(engine)
    servicer.engine = engine
    for s in (*adapter_servers, server):
        await s.set_serving(True)
        s.watch(engine.died)  # health turns NOT_SERVING if the engine thread dies
    for name, s in zip(adapter_ports, adapter_servers):
        logger.info("LoRA adapter %s served as a model of its own on %s (vllm.grpc.engine.VllmEngine)", name, s.address)

    def on_stuck(busy: float) -> None:
        servicer.stuck = f"the engine's step has run for {busy:.0f} s, past --step-timeout ({args.step_timeout:g} s)"
        logger.error("%s: health is NOT_SERVING", servicer.stuck)
        engine.fail_requests(servicer.stuck)
        for s in servers:
            asyncio.ensure_future(s.set_serving(False))

    def on_unstuck(busy: float) -> None:
        servicer.stuck = None
        logger.warning("the engine's stuck step ended: health is SERVING again")
        for s in servers:
            asyncio.ensure_future(s.set_serving(True))

    watchdog = StepWatchdog(engine, args.step_timeout, args.step_timeout_exit, on_stuck, on_unstuck)
    watchdog.start()

    async def stop_when_dead() -> None:  # a dead engine serves nothing again: the process ends, to be restarted
        await engine.died.wait()
        logger.error("the engine core died (%s): the engine stops and exits with code 1", engine.dead)
        server.stop_requested.set()

    tasks = [
        asyncio.ensure_future(stop_when_dead()),
        asyncio.ensure_future(hand_over_at_drain_end(engine, server.stop_requested, args.shutdown_timeout)),
    ]
    try:  # one stop signal: every port drains at once
        await asyncio.gather(*(s.serve_until_stopped() for s in servers))
    finally:
        for task in tasks:
            task.cancel()
        watchdog.stop()
        engine.shutdown()
    if engine.dead is not None:
        sys.exit(1)
