"""`vllm.grpc.engine.VllmEngine` (from the pinned `smg-grpc-proto` package) over the same AsyncLLM.

This is the engine protocol vLLM and the smg router speak, so an existing router can front this engine.
Its conventions, followed here: in streaming mode each step sends one chunk per completion with the new
tokens, and a finished completion also gets a `complete` message (carrying that last step's tokens; the
router accumulates the chunks); without streaming each completion gets one `complete` with everything.
Unlike llmmesh.v1.Engine, requests here may carry stop strings: the engine detokenizes those requests
itself (engine/text) and aborts a completion the moment its text hits one.
"""

import asyncio
import contextlib
import hashlib
import io
import json
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from engine.async_llm import AsyncLLM
from engine.output_processor import RequestOutputKind
from engine.pooling.params import PoolingParams
from services.generate import refuse_generate_on_pooling, serve_embedding, serve_request
from services.server import llmmesh_version
from services.vllm_convert import kv_events_to_vllm, request_output_to_vllm, sampling_params_from_vllm

VLLM_ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "generation_config.json", "config.json",
)  # fmt: skip
TOKENIZER_CHUNK_BYTES = 512 * 1024


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`owner.engine` is the AsyncLLM, None while the model loads (RPCs then answer UNAVAILABLE).

    lora_name: serve this LoRA adapter as a model of its own (its name is the served model name, every Generate
    runs under it). vLLM's protocol carries no adapter in a request, so a router that picks workers by model
    (smg) reaches an adapter through such a servicer on a port of its own (--lora-vllm-ports)."""

    def __init__(self, owner, lora_name: str = ""):
        self.owner = owner
        self.lora_name = lora_name
        self.start_time = time.time()
        self.last_receive_timestamp = 0.0

    async def _ready(self, context) -> AsyncLLM:
        return await self.owner.ready(context)

    # ---- Generate -------------------------------------------------------------------

    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context):
        engine = await self._ready(context)
        self.last_receive_timestamp = time.time()
        refusal = refuse_generate_on_pooling(engine)
        if refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "multimodal inputs: this engine serves text-only models")
        try:
            lora_request = engine.lora_request_named(self.lora_name)
        except LookupError as e:  # unloaded since this port was opened for it
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        params = None  # the request's SamplingParams, once serve_request has admitted it

        def add_request(arrival, trace_headers):
            nonlocal params
            params = sampling_params_from_vllm(request.sampling_params)
            params.detokenize = bool(params.stop)  # token ids travel; text only to find stop strings
            if request.WhichOneof("input") == "text":
                engine.limits.check_chars("text", request.text, "max_prompt_chars")
                prompt_ids = engine.tokenizer.encode(request.text)
            else:
                prompt_ids = list(request.tokenized.input_ids)
            kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
            return engine.add_request(
                request.request_id,
                prompt_ids,
                params,
                arrival_time=arrival,
                output_kind=kind,
                trace_headers=trace_headers,
                lora_request=lora_request,
            )

        vocab = engine.info.vocab_size
        async with contextlib.aclosing(
            serve_request(engine, self.owner.observer, context, request.request_id, add_request, self.lora_name)
        ) as outputs:
            async for out in outputs:
                num_logprobs = vocab if params.logprobs == -1 else params.logprobs or 0
                num_prompt_logprobs = vocab if params.prompt_logprobs == -1 else params.prompt_logprobs or 0
                for message in request_output_to_vllm(out, request.stream, num_logprobs, num_prompt_logprobs):
                    yield message

    # ---- Embed -------------------------------------------------------------------------

    async def Embed(self, request: vllm_engine_pb2.EmbedRequest, context):
        """One prompt's embedding, pooled as the engine's pooler config says (smg's /v1/embeddings sends one
        request a prompt)."""
        engine = await self._ready(context)
        self.last_receive_timestamp = time.time()
        if self.lora_name:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Embed: not offered on a LoRA adapter's port")
        prompt_ids, params = list(request.tokenized.input_ids), PoolingParams()
        if engine.info.runner_type == "pooling":
            try:  # named as this protocol's field
                engine.processor.process_prompt(prompt_ids, params)
            except ValueError as e:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids" + str(e).removeprefix("prompt_token_ids")
                )
        out = await serve_embedding(engine, self.owner.observer, context, request.request_id, prompt_ids, params)
        embedding = out.outputs.data.tolist()
        return vllm_engine_pb2.EmbedResponse(
            embedding=embedding, prompt_tokens=len(out.prompt_token_ids), embedding_dim=len(embedding)
        )

    async def Abort(self, request, context):
        engine = await self._ready(context)
        engine.abort(request.request_ids)
        return vllm_engine_pb2.AbortResponse()

    # ---- information ------------------------------------------------------------------

    async def HealthCheck(self, request, context):
        engine = self.owner.engine
        if engine is None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="loading the model")
        if engine.dead is not None or self.owner.stuck is not None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=engine.dead or self.owner.stuck)
        if self.lora_name and self.lora_name not in engine.info.lora_adapters:
            return vllm_engine_pb2.HealthCheckResponse(
                healthy=False, message=f"LoRA adapter {self.lora_name!r} is not loaded"
            )
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(self, request, context):
        info = (await self._ready(context)).info
        hf_config = json.loads((info.model_dir / "config.json").read_text())
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(info.model_dir),
            is_generation=info.runner_type == "generate",
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            supports_vision=False,
            served_model_name=self.lora_name or info.model,
            tokenizer_path=str(info.model_dir),
            model_type=hf_config.get("model_type", ""),
            architectures=[info.architecture],
            eos_token_ids=info.eos_token_ids,
            pad_token_id=hf_config.get("pad_token_id") or 0,
            bos_token_id=info.bos_token_id or 0,
            max_req_input_len=info.max_model_len - 1,
        )

    async def GetServerInfo(self, request, context):
        engine = await self._ready(context)
        info = engine.info
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(engine.streams),
            is_paused=False,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.start_time,
            server_type="vllm-grpc",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=info.block_size,
            attention_backend=info.attention_backend,
            model_dtype=f"torch.{info.dtype}",
            max_num_seqs=info.max_num_seqs,
        )

    def _scheduler_load(self, engine: AsyncLLM) -> vllm_engine_pb2.SchedulerLoad:
        stats, info = engine.stats, engine.info
        capacity = info.num_kv_cache_tokens
        return vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs,
            num_total_reqs=stats.num_running_reqs + stats.num_waiting_reqs,
            num_used_tokens=round(stats.kv_cache_usage * capacity),
            max_total_num_tokens=capacity,
            token_usage=stats.kv_cache_usage,
            cache_hit_rate=stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            max_running_requests=info.max_num_seqs,
        )

    async def GetLoads(self, request, context):
        engine = await self._ready(context)
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=llmmesh_version(),
            dp_rank_count=1,
            loads=[self._scheduler_load(engine)],
        )

    async def GetTokenizer(self, request, context):
        engine = await self._ready(context)
        data = await asyncio.to_thread(tokenizer_zip, engine.info.model_dir)
        sha256 = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield smg_common_pb2.GetTokenizerChunk(data=data[start:end], sha256=sha256 if end >= len(data) else "")

    async def SubscribeKvEvents(self, request, context):
        engine = await self._ready(context)
        if not engine.info.enable_kv_cache_events:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "KV cache events are off; start the engine with --enable-kv-cache-events"
            )
        queue = engine.subscribe_kv_events()  # bounded: a subscriber that falls behind loses the oldest batches
        # Answer at once (response headers), not at the first event: a router treats a silent
        # subscription as an unreachable worker.
        await context.send_initial_metadata(())
        try:
            # Replay what the history still holds from the requested sequence number on.
            start = request.start_sequence_number
            backlog = [b for b in engine.kv_events.history if start and b[0] >= start]
            for seq, timestamp, events in backlog:
                yield kv_events_to_vllm(seq, timestamp, events)
            last = backlog[-1][0] if backlog else 0
            while True:
                seq, timestamp, events = await queue.get()
                if seq > last:
                    yield kv_events_to_vllm(seq, timestamp, events, self._engine_load(engine))
        finally:
            engine.unsubscribe_kv_events(queue)

    def _engine_load(self, engine: AsyncLLM) -> smg_common_pb2.EngineLoad:
        stats = engine.stats
        return smg_common_pb2.EngineLoad(
            running_requests=stats.num_running_reqs,
            waiting_requests=stats.num_waiting_reqs,
            token_usage=stats.kv_cache_usage,
            max_running_requests=engine.info.max_num_seqs,
        )

    # ---- not offered --------------------------------------------------------------------

    async def FlushCache(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "FlushCache: not offered by this engine yet")

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile: this engine has no profiler hook")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: this engine has no profiler hook")


def tokenizer_zip(model_dir: Path) -> bytes:
    """The model's tokenizer files as one zip, the way the router rebuilds a tokenizer remotely."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                zf.write(model_dir / name, name)
    return buffer.getvalue()
