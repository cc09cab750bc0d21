"""The engine service: `llmmesh.v1.Engine` over gRPC, a thin adapter over EngineCore (via AsyncEngine)."""

import argparse
import asyncio
import os
import time

import grpc

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.output_processor import logprob_dicts
from engine.request import EngineCoreEventType
from engine.sample.sampler import LogprobsTensors
from engine.sched.output import EngineCoreOutput
from engine.text.tokenizer import Tokenizer
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.async_engine import AsyncEngine, EngineError, llmmesh_version
from services.convert import logprobs_to_proto, sampling_params_from_proto
from services.grpc_server import Server, wait_for_termination
from services.vllm_engine import VLLM_ENGINE_SERVICE, VllmEngineServicer, vllm_engine_pb2_grpc

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


def tensors_to_proto(tensors: LogprobsTensors) -> list[common_pb2.PositionLogprobs]:
    """Engine logprob rows -> PositionLogprobs; decoded_token stays empty (the text services fill it)."""
    return logprobs_to_proto(logprob_dicts(tensors, lambda token_id: ""))


class CompletionTracker:
    """What one completion's messages report: usage (on the final one) and timings (first tokens and final)."""

    def __init__(self, arrival_time: float):
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_tokens = 0
        self.num_cached_tokens = 0

    def update(self, out: EngineCoreOutput, step_end: float) -> None:
        for event in out.events:
            if event.type == EngineCoreEventType.SCHEDULED and self.first_scheduled_time is None:
                self.first_scheduled_time = event.timestamp
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = step_end
        self.num_tokens += len(out.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)

    def timings(self, now: float) -> common_pb2.Timings:
        def since_arrival(t):
            return 0.0 if t is None else t - self.arrival_time

        return common_pb2.Timings(
            queue_time=since_arrival(self.first_scheduled_time),
            time_to_first_token=since_arrival(self.first_token_time),
            e2e_latency=now - self.arrival_time,
        )


def to_response(index: int, out: EngineCoreOutput, tracker: CompletionTracker, num_prompt_tokens: int, step_end: float):
    msg = engine_pb2.EngineGenerateResponse(index=index, token_ids=out.new_token_ids)
    if out.new_logprobs is not None:
        msg.logprobs.extend(tensors_to_proto(out.new_logprobs))
    if out.new_prompt_logprobs is not None:
        msg.prompt_logprobs.extend(tensors_to_proto(out.new_prompt_logprobs))
    if out.finished:
        msg.finish_reason = str(out.finish_reason)
        if isinstance(out.stop_reason, int):
            msg.stop_token_id = out.stop_reason
        elif isinstance(out.stop_reason, str):
            msg.stop_str = out.stop_reason
        msg.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=tracker.num_tokens,
                cached_tokens=tracker.num_cached_tokens,
            )
        )
    # The first tokens' message carries the timings too (queue time and time to first token are known
    # then): a caller that stops reading early, at a stop string, still has them.
    if out.finished or (out.new_token_ids and tracker.num_tokens == len(out.new_token_ids)):
        msg.timings.CopyFrom(tracker.timings(step_end))
    return msg


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """llmmesh.v1.Engine. `engine` is None until the model is loaded; RPCs then get UNAVAILABLE."""

    def __init__(self, engine: AsyncEngine | None = None):
        self.engine = engine

    async def _ready(self, context) -> AsyncEngine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model; retry shortly")
        return self.engine

    async def Generate(self, request: engine_pb2.EngineGenerateRequest, context):
        engine = await self._ready(context)
        arrival = time.monotonic()
        try:
            params = sampling_params_from_proto(request.sampling_params)
            stream = engine.add_request(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                priority=request.priority,
                cache_salt=request.cache_salt,
                arrival_time=arrival,
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:  # the engine thread is gone
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        # One message per step per completion, until all n have finished. If the handler is cancelled
        # (client gone, deadline passed) or fails, the unfinished completions are aborted here: their
        # blocks are free before the next step.
        num_prompt_tokens = len(stream.requests[0].prompt_token_ids)
        trackers = {engine_id: CompletionTracker(arrival) for engine_id in stream.index}
        try:
            async for step_end, outputs in stream:
                for out in outputs:
                    if isinstance(out, EngineError):
                        await context.abort(grpc.StatusCode.INTERNAL, f"request {out.request_id}: {out.message}")
                    tracker = trackers[out.request_id]
                    tracker.update(out, step_end)
                    yield to_response(stream.index[out.request_id], out, tracker, num_prompt_tokens, step_end)
        finally:
            engine.close_stream(stream)

    async def Abort(self, request: engine_pb2.AbortRequest, context):
        engine = await self._ready(context)
        return engine_pb2.AbortResponse(num_aborted=engine.abort(request.request_ids))

    async def GetModelInfo(self, request, context):
        core = (await self._ready(context)).core
        return engine_pb2.ModelInfo(
            model=core.args.model,
            architecture=core.model_config.architecture,
            vocab_size=core.model_config.vocab_size,
            max_model_len=core.max_model_len,
            dtype=str(core.dtype).removeprefix("torch."),
            eos_token_ids=core.model_config.eos_token_ids,
        )

    async def GetServerInfo(self, request, context):
        core = (await self._ready(context)).core
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
        load = (await self._ready(context)).load
        return engine_pb2.Load(
            num_running=load.num_running, num_waiting=load.num_waiting, kv_cache_usage=load.kv_cache_usage
        )


# ---- the process -----------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    # Both protocols on one port, over one AsyncEngine.
    server = Server([ENGINE_SERVICE, VLLM_ENGINE_SERVICE], args.host, args.port)
    servicer = EngineServicer()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server.server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(servicer), server.server)
    await server.start()  # health answers NOT_SERVING while the model loads
    engine = AsyncEngine(lambda: EngineCore(engine_args))
    try:
        core = await engine.loaded()
        engine.tokenizer = await asyncio.to_thread(Tokenizer.from_pretrained, core.model_dir)
    except BaseException:
        engine.shutdown(timeout=0)
        await server.stop(0)
        raise
    servicer.engine = engine
    await server.set_serving(True)
    print(f"llmmesh engine listening on {server.address}", flush=True)
    try:
        await wait_for_termination(server, args.shutdown_timeout)
    finally:
        servicer.engine.shutdown()


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))


def add_subcommands(subparsers) -> None:
    parser = subparsers.add_parser(
        "engine", help="serve an EngineCore over gRPC (llmmesh.v1.Engine and vllm.grpc.engine.VllmEngine)"
    )
    env = os.environ.get
    parser.add_argument("--host", default=env("LLMMESH_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("LLMMESH_PORT", "50051")), help="0: any free port")
    parser.add_argument(
        "--shutdown-timeout", type=float, default=float(env("LLMMESH_SHUTDOWN_TIMEOUT", "30")),
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)
