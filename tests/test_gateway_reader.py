"""The gateway's engine reader: whatever goes wrong while it reads one request's engine stream ends that request at
once, INTERNAL and named, and the gateway goes on serving.

The tokenizer, detokenizer and gateway are the real services, in process. The engine is a real gRPC server on a
loopback port that speaks llmmesh.v1.Engine from a script: no real engine sends a message that does not parse, and
that is what it sends for one prompt, after which it keeps the stream open as a stuck engine would.
"""

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from conftest import SERVING, InProcessService, mesh_credentials_of, undecodable, wait_for_health
from llmmesh.v1 import common_pb2, engine_pb2
from services.client import collect, generate

GOOD, BAD = 1000, 1001  # the prompt's first token picks the engine's answer
TOKENS = [504, 3575, 282]  # what the engine "generates" for a good request
STUCK_S = 120.0  # how long the engine holds a bad request's stream open unless the gateway cancels it


class ScriptedEngine:
    """llmmesh.v1.Engine's Generate and GetModelInfo, as raw handlers so that Generate can send bytes that are not
    an EngineGenerateResponse."""

    def __init__(self):
        self.cancelled = threading.Event()  # a bad request's call ended by the gateway

    def generate(self, request: engine_pb2.EngineGenerateRequest, context):
        if request.prompt_token_ids[0] == BAD:
            context.add_callback(self.cancelled.set)
            yield undecodable(engine_pb2.EngineGenerateResponse)
            self.cancelled.wait(STUCK_S)
            return
        msg = engine_pb2.EngineGenerateResponse(num_prompt_tokens=len(request.prompt_token_ids))
        msg.outputs.add(index=0, token_ids=TOKENS, finish_reason="length")
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(TOKENS)))
        yield msg.SerializeToString()

    def model_info(self, request, context):
        return engine_pb2.ModelInfo(model="scripted", vocab_size=49152, max_model_len=2048, eos_token_ids=[2])

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "llmmesh.v1.Engine",
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate, request_deserializer=engine_pb2.EngineGenerateRequest.FromString
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self.model_info,
                    request_deserializer=engine_pb2.GetModelInfoRequest.FromString,
                    response_serializer=engine_pb2.ModelInfo.SerializeToString,
                ),
            },
        )


@pytest.fixture(scope="module")
def engine():
    scripted = ScriptedEngine()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([scripted.handler()])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" is SERVING
    # An engine of the mesh: the gateway reaches it over mutual TLS.
    port = server.add_secure_port("127.0.0.1:0", mesh_credentials_of("engine").server_credentials())
    server.start()
    scripted.address = f"127.0.0.1:{port}"
    yield scripted
    server.stop(0)


@pytest.fixture(scope="module")
def gateway(engine):
    services = {}
    try:
        for name in ("tokenizer", "detokenizer"):
            services[name] = InProcessService(name)
        services["gateway"] = InProcessService(
            "gateway",
            [
                "--engine",
                engine.address,
                "--tokenizer",
                services["tokenizer"].address,
                "--detokenizer",
                services["detokenizer"].address,
                "--shutdown-timeout",
                "5",
            ],
        )
        wait_for_health(services["gateway"].address, SERVING)
        yield services["gateway"].address
    finally:
        for service in reversed(services.values()):
            service.stop()


def test_an_unparsable_engine_message_ends_its_request_internal_at_once(engine, gateway):
    good = collect(generate(gateway, [GOOD, 7], max_tokens=3))
    assert good.token_ids[0] == TOKENS and good.choice().finish_reason == "length"

    # The engine holds the stream for STUCK_S: the request ends long before, and long before its own deadline.
    with pytest.raises(grpc.RpcError) as info:
        collect(generate(gateway, [BAD, 7], max_tokens=3, request_id="req-bad-1", timeout=STUCK_S))
    assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
    assert "'req-bad-1'" in info.value.details() and "AttributeError" in info.value.details()
    assert engine.cancelled.wait(30), "the gateway never cancelled the failed request's engine call"

    # The gateway goes on: SERVING, and the next request is served as before.
    wait_for_health(gateway, SERVING)
    assert list(collect(generate(gateway, [GOOD, 8], max_tokens=3, stream=False)).choice().token_ids) == TOKENS
