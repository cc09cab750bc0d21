"""llmmesh.v1.Sampler: engines stream each step's logits here and get the sampled tokens back, over engine.sample.

One Sample stream per engine. Per stream the service keeps each request's sampling state
(services/sampler_stream.py: its SamplingParams, prompt and output tokens for penalties, min_tokens and bad words,
and its seeded torch.Generator, made when it first samples, as the engine's ModelRunner makes it), updated by what
each step says changed. A step runs the library's SamplingMetadata.from_requests and Sampler on the same rows in
the same order as the engine would, so outputs are identical. A stream whose engine offers shared memory
(mesh.sampler.slots) and can be mapped here gets its logits in place, in the engine's slots, instead of in the
messages, and when the engine's offer names a step channel (mesh.sampler.channel) the service connects to it: that
stream's steps then come and are answered over the Unix socket, sampled on a thread of the stream's own that waits
on it, and the stream stays open, idle, until the engine goes; that thread answers the channel's greedy and sampled steps
in the CPU kernels' loop (kernels/cpu/greedy_steps.cpp) and comes back to Python for any other step. Otherwise a step
of a few rows is sampled on the event loop (a hand-off to a thread and back would cost more than it); larger ones
on one worker thread, so the loop goes on parsing and answering other streams. A message that cannot be used ends
its stream with INVALID_ARGUMENT naming the field; other streams and the service go on.

`llmmesh sampler` runs with OMP_WAIT_POLICY=PASSIVE unless it is set (services/cli.py): the service shares the
host's cores with the engine, and OpenMP threads that spin after a step would take them from the engine's next
forward pass.
"""

import asyncio
import concurrent.futures
import logging
import threading

import grpc
import torch
from google.protobuf.message import DecodeError

from llmmesh.v1 import sampler_pb2, sampler_pb2_grpc
from mesh.sampler.channel import ChannelClosedError
from services.sampler_stream import StreamLimitError, StreamState
from services.server import Server
from services.telemetry import Telemetry, set_error

SERVICE_NAME = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"].full_name
logger = logging.getLogger("llmmesh.sampler")
# Steps of at most this many rows are sampled on the event loop (well under a millisecond each).
INLINE_ROWS = 8


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    def __init__(
        self,
        device: torch.device,
        telemetry: Telemetry | None = None,
        max_streams: int = 64,
        max_requests: int = 65536,
        max_tokens: int = 2**25,
    ):
        self.device = device
        self.max_streams, self.max_requests, self.max_tokens = max_streams, max_requests, max_tokens
        self.telemetry = telemetry or Telemetry("sampler", None)  # tracing off unless the server's is given
        # Every stream's larger steps are sampled on this one thread.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")
        self.num_streams = 0

    async def Sample(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        if self.num_streams >= self.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the sampler has {self.num_streams} streams open, its --max-streams; one more is refused",
            )
        stream = StreamState(self.device, self.max_requests, self.max_tokens)
        self.num_streams += 1
        logger.info("an engine's stream opened (%d open)", self.num_streams)
        try:
            async for msg in request_iterator:
                span = self._span(msg)
                try:
                    if len(msg.request_ids) + len(msg.draft_token_ids) + len(msg.prompt_target_ids) <= INLINE_ROWS:
                        result = stream.step(msg)
                    else:
                        result = await loop.run_in_executor(self.executor, stream.step, msg)
                except ValueError as e:
                    code = refusal_code(e)
                    set_error(span, code, str(e))
                    await context.abort(code, str(e))
                finally:
                    if span is not None:
                        span.end()
                yield result
                if stream.step_channel is not None:  # the engine's later steps come over it
                    error = await self._serve_channel(stream)
                    if isinstance(error, StreamLimitError):
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
                    if isinstance(error, Exception):  # a fault of the service's own ends the stream, as here
                        raise error
                    if error is not None:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
                    return
        finally:
            if stream.step_channel is not None:
                stream.step_channel.close()  # wakes its thread, if the engine cancelled the stream
            self.num_streams -= 1
            logger.info("an engine's stream ended, forgetting its %d requests", len(stream.requests))

    def _span(self, msg: sampler_pb2.SampleStep):
        """A step the engine traces (--collect-detailed-traces): a span under its engine_step span."""
        if not msg.trace_context:
            return None
        attributes = {"llmmesh.sampler.step_id": msg.step_id, "llmmesh.sampler.rows": len(msg.request_ids)}
        return self.telemetry.server_span(
            f"{SERVICE_NAME}/Sample step", msg.trace_context.items(), attributes=attributes
        )

    async def _serve_channel(self, stream: StreamState) -> str | Exception | None:
        """Serve the stream's steps over its step channel on a thread of its own until the engine closes it; what
        ended it otherwise: the message that says why a step was refused, or the service's own exception."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def serve():
            try:
                error = self._serve_steps(stream)
            except Exception as e:  # noqa: BLE001 (handed to the stream, which ends with it)
                error = e
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(error))
            except RuntimeError:  # the server's loop has ended
                pass

        threading.Thread(target=serve, name="sampler-step-channel", daemon=True).start()
        return await done

    def _serve_steps(self, stream: StreamState) -> str | StreamLimitError | None:
        channel = stream.step_channel
        while True:
            length = None
            if stream.serve_greedy_steps is not None:
                length, error = stream.serve_greedy_steps()  # back with the next other frame's length
                if length == -1:  # the engine went or ended the stream
                    return None
                if length == -2:
                    return error
            try:
                msg = sampler_pb2.SampleStep.FromString(channel.recv(length=length))
            except (ChannelClosedError, OSError):  # the engine went or ended the stream
                return None
            except (ValueError, DecodeError) as e:
                return f"step channel: {e}"
            span = self._span(msg)
            try:
                result = stream.step(msg)
            except ValueError as e:
                set_error(span, refusal_code(e), str(e))
                return e if isinstance(e, StreamLimitError) else str(e)
            finally:
                if span is not None:
                    span.end()
            try:
                channel.send(result.SerializeToString())
            except OSError:
                return None
            except ValueError as e:  # an answer over the channel's limit
                return f"step channel: {e}"


def refusal_code(e: ValueError) -> grpc.StatusCode:
    """A step refused: over a bound of the sampler's (RESOURCE_EXHAUSTED), else a bad message."""
    return grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, StreamLimitError) else grpc.StatusCode.INVALID_ARGUMENT


# ---- the process -------------------------------------------------------------------------------


async def serve(args) -> None:
    for name in ("max_streams", "max_requests_per_stream", "max_tokens_per_stream"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(args, name)}.")
    server = Server("sampler", [SERVICE_NAME], args)
    servicer = SamplerServicer(
        torch.device(args.device),
        server.telemetry,
        args.max_streams,
        args.max_requests_per_stream,
        args.max_tokens_per_stream,
    )
    server.add(sampler_pb2_grpc.add_SamplerServicer_to_server, servicer)
    await server.start()
    await server.set_serving(True)
    try:
        await server.serve_until_stopped()
    finally:
        servicer.executor.shutdown(wait=False, cancel_futures=True)
