"""RequestError: how a service ends a request with a gRPC status, and how a dependency's status is passed on."""

import grpc

# Codes a dependency may answer that are about the request, not the dependency: passed on as they are. Not
# CANCELLED: a call its caller cancels raises asyncio.CancelledError, so a dependency's CANCELLED is its server
# stopping.
REQUEST_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,  # the engine failed this request (its step raised)
)


class RequestError(Exception):
    """Ends a request with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message)


def internal(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INTERNAL, message)


def dependency_error(name: str, address: str, err: grpc.aio.AioRpcError) -> RequestError:
    if err.code() in REQUEST_CODES:
        return RequestError(err.code(), err.details() or f"{name}: {err.code().name}")
    return unavailable(f"the {name} at {address} is unavailable: {err.details()}")
