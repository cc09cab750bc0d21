"""`vllm.grpc.engine.VllmEngine` (from the pinned `smg-grpc-proto` package) over the same AsyncEngine.

This is the engine protocol vLLM and the smg router speak, so an existing router can front this engine.
Its conventions, followed here: in streaming mode each step sends one chunk per completion with the new
tokens, and a finished completion also gets a `complete` message (carrying that last step's tokens; the
router accumulates the chunks); without streaming each completion gets one `complete` with everything.
Unlike llmmesh.v1.Engine, requests here may carry stop strings: the engine detokenizes those requests
itself (engine/text) and aborts a completion the moment its text hits one.
"""

import asyncio
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

from engine.kv.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from engine.request import FinishReason, SamplingParams
from engine.sample.sampler import LogprobsTensors
from engine.text.detokenizer import RequestDetokenizer
from services.async_engine import AsyncEngine, EngineError, llmmesh_version

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


def output_logprobs(tensors: LogprobsTensors, num_top: int) -> vllm_engine_pb2.OutputLogProbs:
    msg = vllm_engine_pb2.OutputLogProbs()
    append_output_logprobs(msg, tensors, num_top)
    return msg


def append_output_logprobs(msg: vllm_engine_pb2.OutputLogProbs, tensors: LogprobsTensors, num_top: int) -> None:
    """Each row: the sampled token's logprob, then (when asked for) the row's top k."""
    for ids, lps in zip(tensors.token_ids.tolist(), tensors.logprobs.tolist()):
        msg.token_ids.append(ids[0])
        msg.token_logprobs.append(lps[0])
        if num_top:
            msg.top_logprobs.add(token_ids=ids[1 : num_top + 1], values=lps[1 : num_top + 1])


def input_logprobs(prompt_ids: list[int], tensors: LogprobsTensors, num_top: int) -> vllm_engine_pb2.InputLogProbs:
    """The first prompt token has no logprob (an empty value); rows cover the rest."""
    msg = vllm_engine_pb2.InputLogProbs(token_ids=prompt_ids)
    msg.token_logprobs.add()
    if num_top:
        msg.top_logprobs.add()
    for ids, lps in zip(tensors.token_ids.tolist(), tensors.logprobs.tolist()):
        msg.token_logprobs.add(value=lps[0])
        if num_top:
            msg.top_logprobs.add(token_ids=ids[1 : num_top + 1], values=lps[1 : num_top + 1])
    return msg


def block_hash_to_int64(block_hash: bytes) -> int:
    """The wire carries int64 block hashes: the first 8 bytes of ours, as a signed integer."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def kv_event_batch(seq: int, timestamp: float, events: list, load=None) -> smg_common_pb2.KvEventBatch:
    batch = smg_common_pb2.KvEventBatch(sequence_number=seq, timestamp=timestamp, dp_rank=0)
    for event in events:
        if isinstance(event, BlockStored):
            stored = smg_common_pb2.KvBlocksStored(tier=smg_common_pb2.KV_CACHE_TIER_DEVICE)
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


class Completion:
    """One of the n completions: its tokens so far and, with stop strings, its detokenizer."""

    def __init__(self, index: int, detokenizer: RequestDetokenizer | None):
        self.index = index
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs = vllm_engine_pb2.OutputLogProbs()
        self.finished = False


class GenerateState:
    """One Generate call: turns its engine outputs into VllmEngine messages, finding stop strings."""

    def __init__(self, engine: AsyncEngine, stream, params: SamplingParams, streaming: bool):
        self.engine, self.stream, self.params, self.streaming = engine, stream, params, streaming
        self.prompt_ids = stream.requests[0].prompt_token_ids  # after truncate_prompt_tokens
        self.completions = {
            r.request_id: Completion(
                i, RequestDetokenizer(engine.tokenizer, self.prompt_ids, r.sampling_params) if params.stop else None
            )
            for i, r in enumerate(stream.requests)
        }
        vocab = engine.core.model_config.vocab_size
        self.num_logprobs = vocab if params.logprobs == -1 else params.logprobs or 0
        self.num_prompt_logprobs = vocab if params.prompt_logprobs == -1 else params.prompt_logprobs or 0
        self.cached_tokens = 0
        self.prompt_logprobs: vllm_engine_pb2.InputLogProbs | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions.values())

    def on_output(self, out) -> list[vllm_engine_pb2.GenerateResponse]:
        c = self.completions[out.request_id]
        if c.finished:
            return []  # the abort that follows a stop string: already reported
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if c.detokenizer is not None:
            stop_str = c.detokenizer.update(out.new_token_ids, finish_reason == FinishReason.STOP)
            if stop_str is not None:
                if finish_reason is None:  # end it in the engine now: its blocks are free next step
                    self.engine.abort_engine_requests([out.request_id])
                finish_reason, stop_reason = FinishReason.STOP, stop_str
        c.token_ids += out.new_token_ids
        c.finished = finish_reason is not None
        messages = []
        if self.streaming:
            messages.append(vllm_engine_pb2.GenerateResponse(chunk=self._chunk(c, out)))
        else:
            if out.new_logprobs is not None:
                append_output_logprobs(c.logprobs, out.new_logprobs, self.num_logprobs)
            if out.new_prompt_logprobs is not None:
                self.prompt_logprobs = input_logprobs(self.prompt_ids, out.new_prompt_logprobs, self.num_prompt_logprobs)
        if c.finished:
            messages.append(vllm_engine_pb2.GenerateResponse(complete=self._complete(c, out, finish_reason, stop_reason)))
        return messages

    def _chunk(self, c: Completion, out) -> vllm_engine_pb2.GenerateStreamChunk:
        chunk = vllm_engine_pb2.GenerateStreamChunk(
            token_ids=out.new_token_ids,
            prompt_tokens=len(self.prompt_ids),
            # This chunk's tokens, not the total so far: vLLM's servicer sends the delta count, and the
            # smg router reads vLLM chunks as deltas and adds them up.
            completion_tokens=len(out.new_token_ids),
            cached_tokens=self.cached_tokens,
            index=c.index,
        )
        if out.new_logprobs is not None:
            chunk.output_logprobs.CopyFrom(output_logprobs(out.new_logprobs, self.num_logprobs))
        if out.new_prompt_logprobs is not None:  # once, with the first token of completion 0
            chunk.input_logprobs.CopyFrom(input_logprobs(self.prompt_ids, out.new_prompt_logprobs, self.num_prompt_logprobs))
        return chunk

    def _complete(self, c: Completion, out, finish_reason, stop_reason) -> vllm_engine_pb2.GenerateComplete:
        # Streaming: the last step's tokens (the router accumulates chunks); otherwise all of them.
        token_ids = out.new_token_ids if self.streaming else c.token_ids
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=token_ids,
            finish_reason=str(finish_reason),
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(token_ids),
            cached_tokens=self.cached_tokens,
            index=c.index,
        )
        if isinstance(stop_reason, int):
            complete.matched_token_id = stop_reason
        elif isinstance(stop_reason, str):
            complete.matched_stop_str = stop_reason
        if not self.streaming:
            if self.params.logprobs is not None:
                complete.output_logprobs.CopyFrom(c.logprobs)
            if self.prompt_logprobs is not None and c.index == 0:
                complete.input_logprobs.CopyFrom(self.prompt_logprobs)
        return complete


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`owner.engine` is the AsyncEngine, None while the model loads (RPCs then answer UNAVAILABLE)."""

    def __init__(self, owner):
        self.owner = owner
        self.start_time = time.time()
        self.last_receive_timestamp = 0.0

    async def _ready(self, context) -> AsyncEngine:
        engine = self.owner.engine
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model; retry shortly")
        return engine

    # ---- Generate -------------------------------------------------------------------

    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context):
        engine = await self._ready(context)
        self.last_receive_timestamp = time.time()
        if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "multimodal inputs: this engine serves text-only models")
        try:
            params = sampling_params_from_vllm(request.sampling_params)
            if request.WhichOneof("input") == "text":
                prompt_ids = engine.tokenizer.encode(request.text)
            else:
                prompt_ids = list(request.tokenized.input_ids)
            stream = engine.add_request(request.request_id, prompt_ids, params, arrival_time=time.monotonic())
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

        state = GenerateState(engine, stream, params, request.stream)
        try:
            async for _, outputs in stream:
                for out in outputs:
                    if isinstance(out, EngineError):
                        await context.abort(grpc.StatusCode.INTERNAL, f"request {out.request_id}: {out.message}")
                    for message in state.on_output(out):
                        yield message
                if state.finished:
                    break  # a stop string may end the last completion before its abort comes back
        finally:
            engine.close_stream(stream)

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
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=f"engine thread died: {engine.dead}")
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
            active_requests=len(engine.requests),
            is_paused=False,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.start_time,
            server_type="vllm-grpc",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=core.args.block_size,
            attention_backend=core.args.attention_backend,
            model_dtype=str(core.dtype),
            max_num_seqs=core.args.max_num_seqs,
        )

    def _scheduler_load(self, engine: AsyncEngine) -> vllm_engine_pb2.SchedulerLoad:
        load, core = engine.load, engine.core
        capacity = core.num_blocks * core.args.block_size
        return vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=load.num_running,
            num_waiting_reqs=load.num_waiting,
            num_total_reqs=load.num_running + load.num_waiting,
            num_used_tokens=round(load.kv_cache_usage * capacity),
            max_total_num_tokens=capacity,
            token_usage=load.kv_cache_usage,
            cache_hit_rate=core.kv_cache_manager.prefix_cache_stats.hit_rate,
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

    def _engine_load(self, engine: AsyncEngine) -> smg_common_pb2.EngineLoad:
        load = engine.load
        return smg_common_pb2.EngineLoad(
            running_requests=load.num_running,
            waiting_requests=load.num_waiting,
            token_usage=load.kv_cache_usage,
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
