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
from datetime import datetime, timezone
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from engine.async_llm import AsyncLLM
from engine.kv.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from engine.output_processor import RequestOutputKind
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from services.server import llmmesh_version
from services.engine_telemetry import serve_request

VLLM_ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "generation_config.json", "config.json",
)  # fmt: skip
TOKENIZER_CHUNK_BYTES = 512 * 1024


def sampling_params_from_vllm(msg: vllm_engine_pb2.SamplingParams) -> SamplingParams:
    """vLLM's servicer reading of proto3 zeros: top_p 0 and repetition_penalty 0 mean "unset", n 0 means 1,
    no max_tokens means up to the model's length. A bad value raises ValueError naming the field."""
    constraint = msg.WhichOneof("constraint")
    if constraint is not None:
        raise NotImplementedError(f"sampling_params.{constraint}: structured outputs are not supported by this engine")
    return SamplingParams(
        n=msg.n or 1,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        skip_special_tokens=msg.skip_special_tokens,
        spaces_between_special_tokens=msg.spaces_between_special_tokens,
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias) or None,
        truncate_prompt_tokens=msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None,
    )


def _top(entry: dict, num_top: int) -> tuple[list[int], list[float]]:
    """The top num_top of one position's {token_id: Logprob}, by rank."""
    top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top)
    return [t for _, t, _ in top], [v for _, _, v in top]


def output_logprobs(positions: list[dict], num_top: int) -> vllm_engine_pb2.OutputLogProbs:
    """Each position: the sampled token's logprob (its first entry), then (when asked for) the top k."""
    msg = vllm_engine_pb2.OutputLogProbs()
    for entry in positions:
        token_id, lp = next(iter(entry.items()))
        msg.token_ids.append(token_id)
        msg.token_logprobs.append(lp.logprob)
        if num_top:
            ids, values = _top(entry, num_top)
            msg.top_logprobs.add(token_ids=ids, values=values)
    return msg


def input_logprobs(prompt_ids: list[int], positions: list, num_top: int) -> vllm_engine_pb2.InputLogProbs:
    """The first prompt token has no logprob (an empty value); positions cover the rest."""
    msg = vllm_engine_pb2.InputLogProbs(token_ids=prompt_ids)
    for entry in positions:
        if entry is None:
            msg.token_logprobs.add()
            if num_top:
                msg.top_logprobs.add()
            continue
        msg.token_logprobs.add(value=next(iter(entry.values())).logprob)
        if num_top:
            ids, values = _top(entry, num_top)
            msg.top_logprobs.add(token_ids=ids, values=values)
    return msg


def block_hash_to_int64(block_hash: bytes) -> int:
    """The wire carries int64 block hashes: the first 8 bytes of ours, as a signed integer."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


# Where a BlockStored event's blocks live; the wire's `medium` adds ";loaded_from=kvstore" for blocks that joined
# the device cache by a load from the store.
KV_TIERS = {"device": smg_common_pb2.KV_CACHE_TIER_DEVICE, "kvstore": smg_common_pb2.KV_CACHE_TIER_EXTERNAL}


def kv_event_batch(seq: int, timestamp: float, events: list, load=None) -> smg_common_pb2.KvEventBatch:
    batch = smg_common_pb2.KvEventBatch(sequence_number=seq, timestamp=timestamp, dp_rank=0)
    for event in events:
        if isinstance(event, BlockStored):
            medium = event.medium if event.loaded_from is None else f"{event.medium};loaded_from={event.loaded_from}"
            stored = smg_common_pb2.KvBlocksStored(tier=KV_TIERS[event.medium], medium=medium)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = block_hash_to_int64(event.parent_block_hash)
            for i, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                stored.blocks.add(block_hash=block_hash_to_int64(block_hash), token_ids=tokens, block_size=event.block_size)
            batch.events.add(stored=stored)
        elif isinstance(event, BlockRemoved):
            batch.events.add(removed=smg_common_pb2.KvBlocksRemoved(block_hashes=[block_hash_to_int64(h) for h in event.block_hashes]))
        elif isinstance(event, AllBlocksCleared):
            batch.events.add(cleared=smg_common_pb2.KvCacheCleared())
    if load is not None:
        batch.load.CopyFrom(load)
    return batch


def to_messages(out: RequestOutput, streaming: bool, num_logprobs: int, num_prompt_logprobs: int):
    """One RequestOutput -> VllmEngine messages. Streaming: per step one chunk per completion that moved, and a
    `complete` (with that last step's tokens; the router accumulates the chunks) for each that finished.
    Otherwise (FINAL_ONLY) one `complete` per completion with everything."""
    prompt_ids = out.prompt_token_ids
    for c in out.outputs:
        if streaming:
            chunk = vllm_engine_pb2.GenerateStreamChunk(
                token_ids=c.token_ids,
                prompt_tokens=len(prompt_ids),
                # This chunk's tokens, not the total so far: vLLM's servicer sends the delta count, and the
                # smg router reads vLLM chunks as deltas and adds them up.
                completion_tokens=len(c.token_ids),
                cached_tokens=out.num_cached_tokens,
                index=c.index,
            )
            if c.logprobs:
                chunk.output_logprobs.CopyFrom(output_logprobs(c.logprobs, num_logprobs))
            if out.prompt_logprobs and c.index == 0:  # once, with the first token of completion 0
                chunk.input_logprobs.CopyFrom(input_logprobs(prompt_ids, out.prompt_logprobs, num_prompt_logprobs))
            yield vllm_engine_pb2.GenerateResponse(chunk=chunk)
        if c.finish_reason is None:
            continue
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=c.token_ids,
            finish_reason=c.finish_reason,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(c.token_ids),
            cached_tokens=out.num_cached_tokens,
            index=c.index,
        )
        if isinstance(c.stop_reason, str):
            complete.matched_stop_str = c.stop_reason
        elif c.stop_reason is not None:
            complete.matched_token_id = c.stop_reason
        if not streaming:
            if c.logprobs is not None:
                complete.output_logprobs.CopyFrom(output_logprobs(c.logprobs, num_logprobs))
            if out.prompt_logprobs is not None and c.index == 0:
                complete.input_logprobs.CopyFrom(input_logprobs(prompt_ids, out.prompt_logprobs, num_prompt_logprobs))
        yield vllm_engine_pb2.GenerateResponse(complete=complete)


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`owner.engine` is the AsyncLLM, None while the model loads (RPCs then answer UNAVAILABLE)."""

    def __init__(self, owner):
        self.owner = owner
        self.start_time = time.time()
        self.last_receive_timestamp = 0.0

    async def _ready(self, context) -> AsyncLLM:
        return await self.owner.ready(context)

    # ---- Generate -------------------------------------------------------------------

    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context):
        engine = await self._ready(context)
        self.last_receive_timestamp = time.time()
        if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "multimodal inputs: this engine serves text-only models")
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
            return engine.add_request(request.request_id, prompt_ids, params, arrival_time=arrival, output_kind=kind,
                                      trace_headers=trace_headers)

        vocab = engine.core.model_config.vocab_size
        async with contextlib.aclosing(serve_request(engine, self.owner.observer, context, request.request_id,
                                                     add_request)) as outputs:
            async for out in outputs:
                num_logprobs = vocab if params.logprobs == -1 else params.logprobs or 0
                num_prompt_logprobs = vocab if params.prompt_logprobs == -1 else params.prompt_logprobs or 0
                for message in to_messages(out, request.stream, num_logprobs, num_prompt_logprobs):
                    yield message

    async def Abort(self, request, context):
        engine = await self._ready(context)
        engine.abort(request.request_ids)
        return vllm_engine_pb2.AbortResponse()

    # ---- information ------------------------------------------------------------------

    async def HealthCheck(self, request, context):
        engine = self.owner.engine
        if engine is None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="loading the model")
        if engine.dead is not None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=engine.dead)
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(self, request, context):
        core = (await self._ready(context)).core
        cfg = core.model_config
        hf_config = json.loads((Path(core.model_dir) / "config.json").read_text())
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(core.model_dir),
            is_generation=True,
            max_context_length=core.max_model_len,
            vocab_size=cfg.vocab_size,
            supports_vision=False,
            served_model_name=core.args.model,
            tokenizer_path=str(core.model_dir),
            model_type=hf_config.get("model_type", ""),
            architectures=[cfg.architecture],
            eos_token_ids=cfg.eos_token_ids,
            pad_token_id=hf_config.get("pad_token_id") or 0,
            bos_token_id=cfg.bos_token_id or 0,
            max_req_input_len=core.max_model_len - 1,
        )

    async def GetServerInfo(self, request, context):
        engine = await self._ready(context)
        core = engine.core
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(engine.streams),
            is_paused=False,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.start_time,
            server_type="vllm-grpc",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=core.args.block_size,
            attention_backend=core.worker.attn_backend.name,
            model_dtype=str(core.dtype),
            max_num_seqs=core.args.max_num_seqs,
        )

    def _scheduler_load(self, engine: AsyncLLM) -> vllm_engine_pb2.SchedulerLoad:
        stats, core = engine.stats, engine.core
        capacity = core.num_blocks * core.args.block_size
        return vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs,
            num_total_reqs=stats.num_running_reqs + stats.num_waiting_reqs,
            num_used_tokens=round(stats.kv_cache_usage * capacity),
            max_total_num_tokens=capacity,
            token_usage=stats.kv_cache_usage,
            cache_hit_rate=stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            max_running_requests=core.args.max_num_seqs,
        )

    async def GetLoads(self, request, context):
        engine = await self._ready(context)
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=llmmesh_version(),
            dp_rank_count=1,
            loads=[self._scheduler_load(engine)],
        )

    async def GetTokenizer(self, request, context):
        engine = await self._ready(context)
        data = await asyncio.to_thread(tokenizer_zip, Path(engine.core.model_dir))
        sha256 = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield smg_common_pb2.GetTokenizerChunk(data=data[start:end], sha256=sha256 if end >= len(data) else "")

    async def SubscribeKvEvents(self, request, context):
        engine = await self._ready(context)
        if not engine.core.args.enable_kv_cache_events:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "KV cache events are off; start the engine with --enable-kv-cache-events"
            )
        queue: asyncio.Queue = asyncio.Queue()
        engine.kv_event_subscribers.add(queue)
        # Answer at once (response headers), not at the first event: a router treats a silent
        # subscription as an unreachable worker.
        await context.send_initial_metadata(())
        try:
            # Replay what the history still holds from the requested sequence number on.
            start = request.start_sequence_number
            backlog = [b for b in engine.kv_event_history if start and b[0] >= start]
            for seq, timestamp, events in backlog:
                yield kv_event_batch(seq, timestamp, events)
            last = backlog[-1][0] if backlog else 0
            while True:
                seq, timestamp, events = await queue.get()
                if seq > last:
                    yield kv_event_batch(seq, timestamp, events, self._engine_load(engine))
        finally:
            engine.kv_event_subscribers.discard(queue)

    def _engine_load(self, engine: AsyncLLM) -> smg_common_pb2.EngineLoad:
        stats = engine.stats
        return smg_common_pb2.EngineLoad(
            running_requests=stats.num_running_reqs,
            waiting_requests=stats.num_waiting_reqs,
            token_usage=stats.kv_cache_usage,
            max_running_requests=engine.core.args.max_num_seqs,
        )

    # ---- not offered --------------------------------------------------------------------

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: this engine serves generative models only")

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
