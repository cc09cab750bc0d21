"""Every handler of a server: a span for traced callers, and a count by status code (services/server.py wraps
each handler with instrument())."""

import asyncio
import contextlib

import grpc

from services.telemetry import CURRENT_SERVER_SPAN, Telemetry, set_error


def _code_of(context, error: BaseException | None) -> grpc.StatusCode:
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


class _Call:
    """One RPC's span (if its caller is traced) and its count, ended with the RPC's status."""

    def __init__(self, telemetry: Telemetry, method: str, context):
        self.telemetry, self.method, self.context = telemetry, method, context
        service, _, name = method.lstrip("/").rpartition("/")
        self.service_name, self.method_name = service, name
        self.span = telemetry.server_span(
            f"{service}/{name}",
            context.invocation_metadata(),
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        if self.span is not None:
            CURRENT_SERVER_SPAN.set(self.span)

    def end(self, error: BaseException | None) -> None:
        code = _code_of(self.context, error)
        if self.telemetry.grpc_handled is not None:
            self.telemetry.grpc_handled.labels(self.service_name, self.method_name, code.name).inc()
        if self.span is not None:
            if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                # The caller ended the call (a stop string, a client gone): no fault of this server, so no error
                # status (OpenTelemetry's RPC conventions for server spans), only the code.
                self.span.set_attribute("rpc.grpc.status_code", code.value[0])
            else:
                set_error(self.span, code, self.context.details() or str(error or ""))
            self.span.end()


def instrument(handler: grpc.RpcMethodHandler | None, method: str, telemetry: Telemetry):
    """The handler with a server span and a status-code count around each call; as is when telemetry is off."""
    if handler is None or not telemetry.active:
        return handler
    if handler.unary_unary or handler.stream_unary:
        attr = "unary_unary" if handler.unary_unary else "stream_unary"
        inner = getattr(handler, attr)

        async def unary(request, context):
            call = _Call(telemetry, method, context)
            try:
                response = await inner(request, context)
            except BaseException as e:
                call.end(e)
                raise
            call.end(None)
            return response

        return handler._replace(**{attr: unary})
    attr = "unary_stream" if handler.unary_stream else "stream_stream"
    inner = getattr(handler, attr)

    async def stream(request, context):
        call = _Call(telemetry, method, context)
        try:
            # Closed here, not left to the garbage collector, when the call ends early (cancelled, client gone):
            # the handler's own cleanup (an engine request's abort) runs before the span ends.
            async with contextlib.aclosing(inner(request, context)) as responses:
                async for response in responses:
                    yield response
        except BaseException as e:
            call.end(e)
            raise
        call.end(None)

    return handler._replace(**{attr: stream})
