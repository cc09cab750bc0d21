"""What every service's gRPC server has: health (NOT_SERVING until ready), reflection, clean stop."""

import asyncio
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger("llmmesh.services")

# Messages carry whole-vocabulary logprobs at most: lift gRPC's 4 MiB default.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)]


class Server:
    """A grpc.aio server on host:port with health and reflection for the given full service names."""

    def __init__(self, service_names: list[str], host: str = "127.0.0.1", port: int = 0):
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:  # "" is the whole server
            await self.health.set(name, status)

    async def start(self) -> None:
        # Signal handlers first: a caller may send SIGTERM as soon as it sees the server listen.
        self.stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop_requested.set)
        await self.set_serving(False)
        await self.server.start()
        logger.info("listening on %s (%s)", self.address, ", ".join(self.service_names))

    async def stop(self, grace: float | None = None) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def wait_for_termination(server: Server, shutdown_timeout: float) -> None:
    """Serve until SIGINT/SIGTERM, then stop taking requests and give in-flight ones shutdown_timeout s."""
    await server.stop_requested.wait()
    logger.info("shutting down (up to %.0f s for in-flight requests)", shutdown_timeout)
    await server.stop(shutdown_timeout)


def check_health(address: str, service: str = "", timeout: float = 2.0) -> bool:
    """True when the server at address reports SERVING for service ("" = the whole server)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def add_subcommands(subparsers) -> None:
    parser = subparsers.add_parser("health", help="exit 0 when a service's gRPC health check says SERVING")
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("--service", default="", help="a full service name; empty means the whole server")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.set_defaults(func=lambda args: sys.exit(0 if check_health(args.address, args.service, args.timeout) else 1))
