"""What every service's gRPC server has: health (NOT_SERVING until ready), reflection, clean stop."""

import asyncio
import logging
import signal

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
        await self.set_serving(False)
        await self.server.start()
        logger.info("listening on %s (%s)", self.address, ", ".join(self.service_names))

    async def stop(self, grace: float | None = None) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def wait_for_termination(server: Server, shutdown_timeout: float) -> None:
    """Serve until SIGINT/SIGTERM, then stop taking requests and give in-flight ones shutdown_timeout s."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down (up to %.0f s for in-flight requests)", shutdown_timeout)
    await server.stop(shutdown_timeout)
