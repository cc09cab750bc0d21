"""The gateway's side of vLLM's disaggregated prefill: a kv_producer engine computes the prompt and stores its KV
blocks in the kvstore, and the kv_consumer engine that decodes loads them there."""

import logging

import grpc

from llmmesh.v1 import common_pb2, engine_pb2
from services.dependencies import ENGINE_DOWN
from services.kv_transfer_params import REMOTE_DECODE_PARAMS, REMOTE_PREFILL_PARAMS
from services.telemetry import inject

logger = logging.getLogger("llmmesh.gateway")


async def remote_prefill(call) -> None:
    """Compute the prompt of `call` (a services.engine_call.EngineCall) on a prefill engine first (max_tokens 1, its
    token dropped), which answers once every full prompt block is in the kvstore; then the decode engine loads them and
    computes only the rest, its first token too, so its output is what one engine gives. A prefill engine that
    fails costs the decode engine the prompt's computation, never the request. While it runs, call.call is the
    prefill's, so that cancelling the request cancels it."""
    request = call.engine_request
    request.kv_transfer_params = REMOTE_PREFILL_PARAMS
    if request.sampling_params.HasField("prompt_logprobs"):
        return  # every prompt position runs on the decode engine anyway
    address = call.deps.prefill_engine()
    if address is None:
        return
    params = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    if request.sampling_params.HasField("truncate_prompt_tokens"):
        params.truncate_prompt_tokens = request.sampling_params.truncate_prompt_tokens
    prefill = engine_pb2.EngineGenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=call.prompt_ids,
        sampling_params=params,
        cache_salt=request.cache_salt,
        kv_transfer_params=REMOTE_DECODE_PARAMS,
        lora_name=request.lora_name,
    )
    with call.telemetry.client_call("remote_prefill", call.span, {"server.address": address}) as s:
        # A hung prefill engine costs at most --prefill-timeout, a dead one its health check or the failed call.
        call.call = call.deps.prefill(address, prefill, call.context.time_remaining(), inject(s))
        try:
            async for msg in call.call:
                if msg.kv_transfer_params:
                    request.kv_transfer_params = msg.kv_transfer_params
        except grpc.aio.AioRpcError as e:
            if call.context.done():
                raise
            if e.code() in ENGINE_DOWN:
                call.deps.mark_prefill_down(address)  # until its next health check
            logger.warning(
                "prefill engine %s: %s (%s); the decode engine computes the prompt of %s",
                address,
                e.code().name,
                e.details(),
                call.request_id,
            )
        finally:
            call.call = None
