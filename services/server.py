"""What every service's gRPC server and client channel share, defined once.

The server: mutual TLS with the mesh's certificates and the callers mesh/tls.py allows each gRPC service (the
gateway's public port: its own TLS), health (NOT_SERVING until ready, and again when the service breaks or drains), reflection,
SIGINT/SIGTERM with a drain, one keepalive policy, and requests that do not decode answered with
INVALID_ARGUMENT. The channels: the same keepalive policy, so neither end ever sends more pings than
the other accepts, and a quick reconnect to a dependency restarted at the same address.
"""

import argparse
import asyncio
import importlib.metadata
import logging
import signal
import sys
import threading

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger("llmmesh.server")

from engine.config.utils import add_cli_args  # noqa: E402
from mesh import tls  # noqa: E402
from mesh.grpc_policy import CHANNEL_OPTIONS, KEEPALIVE_TIME_MS, MAX_MESSAGE_BYTES, SERVER_OPTIONS  # noqa: E402, F401
from services.handler_telemetry import instrument  # noqa: E402
from services.settings import HealthFlags  # noqa: E402
from services.telemetry import Telemetry  # noqa: E402


def credentials(args, identity: str) -> tls.MeshCredentials | None:
    """A service's own credentials from its flags (--tls-dir); None under --insecure-plaintext."""
    return None if args.insecure_plaintext else tls.MeshCredentials(args.tls_dir or tls.default_tls_dir(), identity)


def channel(address: str, server: str, credentials: tls.MeshCredentials | None) -> grpc.aio.Channel:
    """An asyncio channel to another service of the mesh (`server`: its identity), presenting `credentials`."""
    return tls.aio_channel(address, server, credentials)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None


def public_credentials(args, own: tls.MeshCredentials) -> grpc.ServerCredentials:
    """The gateway's public port: --tls-cert and --tls-key, or the mesh's gateway certificate; client certificates of
    --tls-ca when given."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    pair = (_read(args.tls_key, "--tls-key"), _read(args.tls_cert, "--tls-cert")) if args.tls_cert else own.key_pair()
    ca = _read(args.tls_ca, "--tls-ca") if args.tls_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def llmmesh_version() -> str:
    try:
        return importlib.metadata.version("llmmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- requests that do not decode --------------------------------------------------------------------


class _Undecodable:
    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, ValueError, RuntimeError) as e:  # protobuf's parse errors
            return _Undecodable(e)

    return deserialize


async def _refuse(context, bad: _Undecodable):
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not decode: {bad.error}")


async def _checked(request_iterator, context):
    async for request in request_iterator:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        yield request


async def _no_guard(context) -> None:
    pass


def _guard(service: str):
    """Refuse a peer whose mesh identity may not call `service` with PERMISSION_DENIED (the TLS handshake has already
    refused one without a certificate of the mesh's CA)."""

    async def check(context) -> None:
        if reason := tls.refusal(service, tls.peer_identity(context.auth_context())):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

    return check


def _harden(handler: grpc.RpcMethodHandler | None, guard=_no_guard) -> grpc.RpcMethodHandler | None:
    """A handler that first awaits guard(context), and whose undecodable requests get INVALID_ARGUMENT (gRPC itself
    would answer INTERNAL)."""
    if handler is None or handler.request_deserializer is None:
        return handler
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            await guard(context)
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            return await inner(request, context)

        changes = {"unary_unary": unary_unary}
    elif handler.unary_stream:
        inner = handler.unary_stream

        async def unary_stream(request, context):
            await guard(context)
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async for response in inner(request, context):
                yield response

        changes = {"unary_stream": unary_stream}
    elif handler.stream_unary:
        inner = handler.stream_unary

        async def stream_unary(request_iterator, context):
            await guard(context)
            return await inner(_checked(request_iterator, context), context)

        changes = {"stream_unary": stream_unary}
    else:
        inner = handler.stream_stream

        async def stream_stream(request_iterator, context):
            await guard(context)
            async for response in inner(_checked(request_iterator, context), context):
                yield response

        changes = {"stream_stream": stream_stream}
    return handler._replace(request_deserializer=_lenient(handler.request_deserializer), **changes)


class _HardenedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, telemetry: Telemetry, authorize: bool):
        self.inner = inner
        self.telemetry = telemetry
        self.authorize = authorize

    def service(self, handler_call_details):
        method = handler_call_details.method  # /package.Service/Method
        guard = _guard(method.split("/")[1]) if self.authorize else _no_guard
        handler = _harden(self.inner.service(handler_call_details), guard)
        return instrument(handler, method, self.telemetry)


class _Registrar:
    """What the generated add_*Servicer_to_server functions are given: it hardens every handler, and with
    authorize checks each call's peer against the mesh's table of callers."""

    def __init__(self, server: grpc.aio.Server, telemetry: Telemetry, authorize: bool):
        self.server = server
        self.telemetry = telemetry
        self.authorize = authorize

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.server.add_generic_rpc_handlers([_HardenedGeneric(h, self.telemetry, self.authorize) for h in handlers])

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        # Registered handlers skip the generic lookup: leave them unregistered so the hardened generic
        # handlers, added next by the same generated function, serve every method.
        pass


# ---- the server ---------------------------------------------------------------------------------


class Server:
    """A grpc.aio server on args.host:args.port with health and reflection for the given full service names, serving
    mutual TLS with the identity `name` from args.tls_dir (public: the gateway's public port, args.tls_cert...), or
    plaintext on loopback under args.insecure_plaintext.

    `add(add_servicer_fn, servicer)` registers a servicer; start(), set_serving(True) (which announces the
    address on stdout), then serve_until_stopped() drains on SIGINT/SIGTERM."""

    def __init__(
        self,
        name: str,
        service_names: list[str],
        args,
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        interceptors=(),
        owner: "Server | None" = None,
        public: bool = False,
    ):
        """owner: the service's main server, when this one is another port of the same process (see sibling)."""
        self.name = name
        self.args = args
        self.credentials = credentials(args, name)
        if self.credentials is None:
            tls.check_plaintext_host(args.host)
            if public and (args.tls_cert or args.tls_ca):
                raise ValueError("--insecure-plaintext serves no TLS: drop --tls-cert and --tls-ca, or it")
        self.shutdown_timeout = args.shutdown_timeout
        # Calls past the bound get RESOURCE_EXHAUSTED from gRPC itself, before any handler runs.
        self.server = grpc.aio.server(
            interceptors=list(interceptors),
            maximum_concurrent_rpcs=args.max_concurrent_rpcs,
            options=SERVER_OPTIONS
            + [
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", max_receive_bytes),
            ],
        )
        # Traces and metrics (--otlp-traces-endpoint, --metrics-port): every handler registered through add().
        self.owner = owner
        self.telemetry = owner.telemetry if owner is not None else Telemetry(name, args)
        self.registrar = _Registrar(self.server, self.telemetry, authorize=self.credentials is not None and not public)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        where = f"{args.host}:{args.port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(where)
        elif public:
            self.port = self.server.add_secure_port(where, public_credentials(args, self.credentials))
        else:
            self.port = self.server.add_secure_port(where, self.credentials.server_credentials())
        self.address = f"{args.host}:{self.port}"
        if getattr(args, "unix_socket", None):  # the services behind the gateway (UnixSocketConfig)
            tls.check_private_socket(args.unix_socket)
            if self.credentials is None:
                self.server.add_insecure_port(f"unix:{args.unix_socket}")
            else:  # the same mutual TLS as the TCP port: every link of the mesh is
                self.server.add_secure_port(f"unix:{args.unix_socket}", self.credentials.server_credentials())
        self.stop_requested = owner.stop_requested if owner is not None else asyncio.Event()
        self.broken: str | None = None  # why the service can no longer serve (health stays NOT_SERVING)
        self.announced = False
        self._watchers: list[asyncio.Task] = []
        self.servicers: list = []  # what add() registered, for whoever holds the server (an in-process test)

    def sibling(self, service_names: list[str], port: int, **args) -> "Server":
        """Another server of this process on `port`, for services that need a port of their own: it shares this
        one's telemetry and stop signal (SIGTERM stops both); start and stop it beside this one. args: flags of
        its own (host, insecure_plaintext)."""
        namespace = argparse.Namespace(**{**vars(self.args), "port": port, "unix_socket": None, **args})
        return Server(self.name, service_names, namespace, owner=self)

    def add(self, add_servicer_to_server, servicer) -> None:
        add_servicer_to_server(servicer, self.registrar)
        self.servicers.append(servicer)

    async def set_serving(self, serving: bool) -> None:
        serving = serving and self.broken is None and not self.stop_requested.is_set()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:  # "" is the whole server
            await self.health.set(name, status)
        if serving and not self.announced and self.owner is None:  # a sibling's address is its owner's to tell
            self.announced = True
            print(f"llmmesh {self.name} listening on {self.address}", flush=True)

    def watch(self, broken: asyncio.Event, reason: str = "") -> None:
        """Once `broken` is set, health says NOT_SERVING for good."""

        async def wait():
            await broken.wait()
            self.broken = reason or "broken"
            logger.error("the %s can no longer serve: health is NOT_SERVING", self.name)
            await self.set_serving(False)

        self._watchers.append(asyncio.create_task(wait()))

    def follow(self, check, what: str, interval: float = 0.5) -> None:
        """Health in step with a dependency: `check()` (async, True when `what` answers) is asked every
        `interval` s, and health says SERVING while it answers, NOT_SERVING while it does not."""

        async def poll():
            serving = None
            while True:
                ok = await check()
                if ok != serving:
                    logger.log(
                        logging.INFO if ok else logging.WARNING,
                        "%s %s: health is %s",
                        what,
                        "answers" if ok else "does not answer",
                        "SERVING" if ok else "NOT_SERVING",
                    )
                    await self.set_serving(ok)
                    serving = ok
                await asyncio.sleep(interval)

        self._watchers.append(asyncio.create_task(poll()))

    async def start(self) -> None:
        # Signal handlers first: a caller may send SIGTERM as soon as it sees the server listen. Only the main
        # thread can have them: a server run on another thread (in a test) is stopped through stop_requested.
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.stop_requested.set)
        await self.set_serving(False)
        await self.server.start()
        if self.owner is None:
            self.telemetry.start()
        logger.info("listening on %s (%s)", self.address, ", ".join(self.service_names))

    async def stop(self, grace: float | None = None) -> None:
        self.stop_requested.set()
        await self.set_serving(False)
        for task in self._watchers:
            task.cancel()
        await self.server.stop(grace)
        if self.owner is None:
            self.telemetry.shutdown()  # the spans of the calls that just ended go out

    async def serve_until_stopped(self) -> None:
        """Serve until SIGINT/SIGTERM, then refuse new calls and give in-flight ones shutdown_timeout s."""
        await self.stop_requested.wait()
        logger.info("shutting down (up to %.0f s for in-flight calls)", self.shutdown_timeout)
        await self.stop(self.shutdown_timeout)


def check_health(
    address: str, credentials: tls.MeshCredentials | None, service: str = "", timeout: float = 2.0
) -> bool:
    """True when the server at address (the identity credentials names, which it also presents) reports SERVING for
    service ("" = the whole server)."""
    server = credentials.identity if credentials is not None else ""
    with tls.channel(address, server, credentials) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def add_subcommands(subparsers) -> None:
    parser = subparsers.add_parser("health", help="exit 0 when a service's gRPC health check says SERVING")
    add_cli_args(parser, HealthFlags, grouped=False)
    parser.set_defaults(func=run_health)


def run_health(args) -> None:
    healthy = check_health(args.address, credentials(args, args.identity), args.service, args.timeout)
    sys.exit(0 if healthy else 1)
