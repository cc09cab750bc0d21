"""One Generate (or Embed) call of either engine protocol (llmmesh.v1.Engine, vLLM's VllmEngine), driven the same
way: the request admitted, its outputs streamed, its failures mapped to gRPC status codes, its telemetry watched."""

import contextlib
import time

import grpc

from engine.async_llm import EngineDeadError, EngineQueueFullError, EngineRequestError
from engine.output_processor import RequestOutputKind
from engine.outputs import PoolingRequestOutput
from engine.pooling.params import PoolingParams
from services.engine_telemetry import EngineTelemetry
from services.telemetry import CURRENT_SERVER_SPAN


async def serve_request(
    engine, observer: EngineTelemetry | None, context, request_id: str, add_request, lora_name: str = ""
):
    """One Generate call of either engine protocol: admit the request and yield its outputs, watched.

    add_request(arrival, trace_headers) -> RequestStream admits it; its ValueError, NotImplementedError,
    EngineQueueFullError and EngineDeadError end the call INVALID_ARGUMENT, UNIMPLEMENTED, RESOURCE_EXHAUSTED and
    UNAVAILABLE; a request the engine failed on its own ends INVALID_ARGUMENT (its input), UNAVAILABLE (the
    sampler service) or INTERNAL (naming it). The request's metrics and span start at its arrival, and its
    unfinished completions are aborted when the call ends any way but finished (close_stream: their blocks are free before the next step). Callers iterate it
    under contextlib.aclosing, so a cancelled call runs this cleanup at once, not when the generator is collected.
    Telemetry goes through engine.call_hook: a hook that raises is counted, and the request goes on.
    """
    arrival = time.monotonic()
    server_span = CURRENT_SERVER_SPAN.get()
    watch = engine.call_hook(observer.watch, server_span, request_id, arrival, lora_name) if observer else None
    stream = None
    try:
        try:
            stream = add_request(arrival, watch.trace_headers if watch is not None else ())
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineQueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if watch is not None:
            engine.call_hook(watch.admitted, stream.state)
        async for out in stream:
            if watch is not None:
                engine.call_hook(watch.output, out)
            yield out
    except EngineDeadError as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except EngineRequestError as e:
        code = (
            grpc.StatusCode.UNAVAILABLE
            if e.unavailable
            else grpc.StatusCode.INVALID_ARGUMENT
            if e.invalid_input
            else grpc.StatusCode.INTERNAL
        )
        message = str(e) if str(e).startswith(f"request {request_id}") else f"request {request_id}: {e}"
        await context.abort(code, message)
    finally:
        if stream is not None:
            engine.close_stream(stream)
        if watch is not None:
            engine.call_hook(watch.end)


async def serve_embedding(
    engine,
    observer: EngineTelemetry | None,
    context,
    request_id: str,
    prompt_ids: list[int],
    params: PoolingParams,
    priority: int = 0,
    cache_salt: str = "",
) -> PoolingRequestOutput:
    """One Embed call of either engine protocol: FAILED_PRECONDITION from a generating engine, else the request run
    as serve_request runs a Generate one (its refusals and failures mapped alike); its pooled output."""
    if engine.info.runner_type != "pooling":
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "Embed: this engine runs --runner generate (a generative model); embeddings need an engine serving an "
            "embedding model with --runner pooling",
        )

    def add_request(arrival, trace_headers):
        return engine.add_request(
            request_id,
            prompt_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=arrival,
            output_kind=RequestOutputKind.FINAL_ONLY,
            trace_headers=trace_headers,
        )

    async with contextlib.aclosing(serve_request(engine, observer, context, request_id, add_request)) as outputs:
        async for out in outputs:
            if isinstance(out, PoolingRequestOutput):
                return out
    await context.abort(grpc.StatusCode.ABORTED, f"request {request_id}: aborted before its prompt ran")


def refuse_generate_on_pooling(engine) -> str | None:
    """Why a Generate call cannot run here (a pooling engine), or None."""
    if engine.info.runner_type == "pooling":
        return (
            "Generate: this engine runs --runner pooling (an embedding model): it embeds prompts (Embed) and "
            "generates nothing"
        )
    return None


@contextlib.contextmanager
def images_named(field: str):
    """The engine's checks name a request's images multi_modal_data.image[i] (the offline API's field); a service
    names its own protocol's field."""
    try:
        yield
    except ValueError as e:
        raise ValueError(str(e).replace("multi_modal_data.image", field)) from None
