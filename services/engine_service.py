"""The engine service: `llmmesh.v1.Engine` and vLLM's `VllmEngine` on one port, thin adapters over AsyncLLM."""

import asyncio
import contextlib
import time

import grpc

from engine.async_llm import AsyncLLM
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.text.tokenizer import Tokenizer
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services import config
from services.convert import logprobs_to_proto, sampling_params_from_proto
from services.engine_telemetry import EngineTelemetry, serve_request
from services.server import Server, llmmesh_version
from services.vllm_engine import VLLM_ENGINE_SERVICE, VllmEngineServicer, vllm_engine_pb2_grpc

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


def timings(out: RequestOutput) -> common_pb2.Timings:
    m = out.metrics
    return common_pb2.Timings(
        queue_time=m.time_in_queue or 0.0,
        time_to_first_token=m.time_to_first_token or 0.0,
        e2e_latency=time.monotonic() - m.arrival_time,
        prefill_time=m.prefill_time or 0.0,
        decode_time=m.decode_time or 0.0,
    )


def to_response(out: RequestOutput, first_tokens: bool) -> engine_pb2.EngineGenerateResponse:
    """One step's RequestOutput (delta) -> one message with every completion that moved."""
    msg = engine_pb2.EngineGenerateResponse()
    for c in out.outputs:
        delta = msg.outputs.add(index=c.index, token_ids=c.token_ids, finish_reason=c.finish_reason or "")
        if c.logprobs:
            delta.logprobs.extend(logprobs_to_proto(c.logprobs))
        if isinstance(c.stop_reason, str):
            delta.stop_str = c.stop_reason
        elif c.stop_reason is not None:
            delta.stop_token_id = c.stop_reason
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs))
    if first_tokens:
        msg.num_prompt_tokens = len(out.prompt_token_ids)
    if out.finished:
        msg.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=out.metrics.num_generation_tokens,
            cached_tokens=out.num_cached_tokens,
        ))
    # The first tokens' message carries the timings too: a caller that stops reading early, at a stop
    # string, still has the queue time and the time to first token.
    if out.finished or first_tokens:
        msg.timings.CopyFrom(timings(out))
    return msg


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """llmmesh.v1.Engine. `engine` is None until the model is loaded; RPCs then get UNAVAILABLE."""

    def __init__(self, engine: AsyncLLM | None = None):
        self.engine = engine
        self.observer: EngineTelemetry | None = None  # metrics and request spans, when either is on

    async def ready(self, context) -> AsyncLLM:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model; retry shortly")
        if self.engine.dead is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.dead)
        return self.engine

    async def Generate(self, request: engine_pb2.EngineGenerateRequest, context):
        engine = await self.ready(context)

        def add_request(arrival, trace_headers):
            params = sampling_params_from_proto(request.sampling_params)
            params.detokenize = bool(params.stop)  # token ids travel; text only to find stop strings
            return engine.add_request(
                request.request_id, list(request.prompt_token_ids), params, priority=request.priority,
                cache_salt=request.cache_salt, arrival_time=arrival, trace_headers=trace_headers,
            )

        first_tokens = True
        async with contextlib.aclosing(serve_request(engine, self.observer, context, request.request_id,
                                                     add_request)) as outputs:
            async for out in outputs:
                moved = any(c.token_ids for c in out.outputs)
                yield to_response(out, first_tokens and moved)
                first_tokens = first_tokens and not moved

    async def Abort(self, request: engine_pb2.AbortRequest, context):
        engine = await self.ready(context)
        return engine_pb2.AbortResponse(num_aborted=engine.abort(request.request_ids))

    async def GetModelInfo(self, request, context):
        core = (await self.ready(context)).core
        return engine_pb2.ModelInfo(
            model=core.args.model,
            architecture=core.model_config.architecture,
            vocab_size=core.model_config.vocab_size,
            max_model_len=core.max_model_len,
            dtype=str(core.dtype).removeprefix("torch."),
            eos_token_ids=core.model_config.eos_token_ids,
        )

    async def GetServerInfo(self, request, context):
        core = (await self.ready(context)).core
        args = core.args
        return engine_pb2.ServerInfo(
            version=llmmesh_version(),
            block_size=args.block_size,
            num_gpu_blocks=core.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_logprobs=args.max_logprobs,
            device=str(core.device),
        )

    async def GetLoad(self, request, context):
        stats = (await self.ready(context)).stats
        return engine_pb2.Load(
            num_running=stats.num_running_reqs, num_waiting=stats.num_waiting_reqs, kv_cache_usage=stats.kv_cache_usage
        )


# ---- the process -----------------------------------------------------------------


async def serve(args) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    # Both protocols on one port, over one AsyncLLM.
    server = Server("engine", [ENGINE_SERVICE, VLLM_ENGINE_SERVICE], args)
    servicer = EngineServicer()
    server.add(engine_pb2_grpc.add_EngineServicer_to_server, servicer)
    server.add(vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, VllmEngineServicer(servicer))
    await server.start()  # health answers NOT_SERVING while the model loads
    engine = AsyncLLM(lambda: EngineCore(engine_args), config.limits_from_args(args))
    try:
        core = await engine.loaded()
        engine.set_tokenizer(await asyncio.to_thread(Tokenizer.from_pretrained, core.model_dir))
    except BaseException:
        engine.shutdown(timeout=0)
        await server.stop(0)
        raise
    observer = EngineTelemetry(server.telemetry, servicer, args.model, args.collect_detailed_traces)
    if observer.active:
        servicer.observer = observer
        observer.attach(engine)
    servicer.engine = engine
    await server.set_serving(True)
    server.watch(engine.died)  # health turns NOT_SERVING if the engine thread dies
    try:
        await server.serve_until_stopped()
    finally:
        engine.shutdown()
