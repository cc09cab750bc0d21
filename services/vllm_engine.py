"""`vllm.grpc.engine.VllmEngine` (from the pinned `smg-grpc-proto` package) over the same AsyncLLM.

This is the engine protocol vLLM and the smg router speak, so an existing router can front this engine.
Its conventions, followed here: in streaming mode each step sends one chunk per completion with the new
tokens, and a finished completion also gets a `complete` message (carrying that last step's tokens; the
router accumulates the chunks); without streaming each completion gets one `complete` with everything.
Unlike llmmesh.v1.Engine, requests here may carry stop strings: the engine detokenizes those requests
itself (engine/text) and aborts a completion the moment its text hits one.

Images (a vision-language model) come in either of the router's two shapes: `mm_inputs`, preprocessed by the
router (tensors, placeholder ranges in the token ids), or `media_refs`, URLs the worker loads and preprocesses
itself (services/vision.py: data: URLs, or files under --allowed-local-media-path; nothing is fetched). Either way
each image is named by the content hash of its tensors as computed here, never by a hash the request brings: the
encoder cache and the prefix cache share entries across requests by it.
"""

import asyncio
import contextlib
import hashlib
import io
import json
import math
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
from llmmesh.v1 import common_pb2
from services.convert import tensor_from_llmmesh
from services.generate import images_named, refuse_generate_on_pooling, serve_embedding, serve_request
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

    def __init__(self, owner, lora_name: str = "", allowed_local_media_path: str = ""):
        self.owner = owner
        self.lora_name = lora_name
        self.allowed_local_media_path = allowed_local_media_path  # where media_refs' file: URLs may point
        self.start_time = time.time()
        self.last_receive_timestamp = 0.0
        self._media = None  # services.vision.MediaRefProcessor, on the first request with media_refs

    async def _ready(self, context) -> AsyncLLM:
        return await self.owner.ready(context)

    # ---- Generate -------------------------------------------------------------------

    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context):
        engine = await self._ready(context)
        self.last_receive_timestamp = time.time()
        refusal = refuse_generate_on_pooling(engine)
        if refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        try:
            lora_request = engine.lora_request_named(self.lora_name)
        except LookupError as e:  # unloaded since this port was opened for it
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        images_field, prompt_ids, mm_features = "", None, None
        if request.HasField("media_refs") or request.HasField("mm_inputs") or request.extra_mm_inputs:
            images_field = "media_refs.items" if request.HasField("media_refs") else "mm_inputs.mm_placeholders"
            try:
                # Decoding and preprocessing images takes a while: not on the event loop.
                prompt_ids, mm_features = await asyncio.to_thread(self._images, engine, request)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        params = None  # the request's SamplingParams, once serve_request has admitted it

        def add_request(arrival, trace_headers):
            nonlocal params, prompt_ids
            params = sampling_params_from_vllm(request.sampling_params)
            params.detokenize = bool(params.stop)  # token ids travel; text only to find stop strings
            if prompt_ids is None and request.WhichOneof("input") == "text":
                engine.limits.check_chars("text", request.text, "max_prompt_chars")
                prompt_ids = engine.tokenizer.encode(request.text)
            elif prompt_ids is None:
                prompt_ids = list(request.tokenized.input_ids)
            kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
            with images_named(images_field or "multi_modal_data.image"):
                return engine.add_request(
                    request.request_id,
                    prompt_ids,
                    params,
                    arrival_time=arrival,
                    output_kind=kind,
                    trace_headers=trace_headers,
                    lora_request=lora_request,
                    mm_features=mm_features,
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

    def _images(self, engine: AsyncLLM, request: vllm_engine_pb2.GenerateRequest):
        """A request's (prompt token ids, MultiModalFeatureSpecs) from its mm_inputs or media_refs; ValueError
        naming the field at fault."""
        info = engine.processor.mm_info
        if info is None:
            raise ValueError(f"images: the model ({engine.info.architecture}) takes no images (it is text-only)")
        if request.WhichOneof("input") != "tokenized":
            raise ValueError("tokenized: a request with images carries its prompt as token ids (the router's)")
        token_ids = list(request.tokenized.input_ids)
        if not request.HasField("media_refs"):
            batches = [("mm_inputs", request.mm_inputs)] if request.HasField("mm_inputs") else []
            batches += [(f"extra_mm_inputs[{i}]", b) for i, b in enumerate(request.extra_mm_inputs)]
            features = [f for field, batch in batches for f in mm_features_from_vllm(batch, token_ids, info, field)]
            return token_ids, sorted(features, key=lambda f: f.mm_position.offset)
        if request.HasField("mm_inputs") or request.extra_mm_inputs:
            raise ValueError("media_refs: give the images as media_refs or as mm_inputs, not both")
        from services.vision import MediaRefProcessor, expands_anchors

        if not expands_anchors(info):
            raise ValueError(
                f"media_refs: not taken for {engine.info.architecture}; send its images preprocessed (mm_inputs)"
            )
        for i, item in enumerate(request.media_refs.items):
            if item.modality not in (smg_common_pb2.MODALITY_UNSPECIFIED, smg_common_pb2.IMAGE):
                name = smg_common_pb2.Modality.Name(item.modality)
                raise ValueError(f"media_refs.items[{i}].modality: {name} is not supported; IMAGE is")
        if self._media is None:
            self._media = MediaRefProcessor(
                engine.info.model_dir, info, engine.processor.mm_limits, self.allowed_local_media_path
            )
        return self._media(token_ids, [item.url for item in request.media_refs.items], "media_refs.items")

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
        engine = await self._ready(context)
        info = engine.info
        hf_config = json.loads((info.model_dir / "config.json").read_text())
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(info.model_dir),
            is_generation=info.runner_type == "generate",
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            supports_vision=engine.processor.mm_info is not None,
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
            **self._media_info(engine),
        )

    def _media_info(self, engine: AsyncLLM) -> dict:
        """GetServerInfo's image fields: the router holds a request's images to these limits, and sends them as
        media references (`--mm-processing worker`) only to a worker that names its processor."""
        from services.vision import expands_anchors

        info, limits = engine.processor.mm_info, engine.processor.mm_limits
        if info is None:
            return {}
        schemes = "data,file" if self.allowed_local_media_path else "data"
        return dict(
            mm_processor="inprocess" if expands_anchors(info) else "",
            mm_media_ref_schemes=schemes if expands_anchors(info) else "",
            mm_processor_source="default" if expands_anchors(info) else "",
            mm_item_limits=f"image={limits.limit_mm_per_prompt}",
            multimodal_encoder_dtype=engine.info.dtype,
            mm_encoder_budget=min(limits.max_num_encoder_input_tokens, limits.encoder_cache_size),
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


# ---- images the router preprocessed (vLLM's MultimodalInputs) ------------------------------------------------------


def tensor_from_vllm(msg: vllm_engine_pb2.TensorData, where: str):
    """A tensor carried inline (the router's shared-memory and remote transports are not taken)."""
    payload = msg.WhichOneof("payload")
    if payload != "inline":
        raise ValueError(
            f"{where}: a {payload or 'missing'} payload; this engine takes tensors inline "
            "(smg --multimodal-tensor-transport inline)"
        )
    if msg.dtype == "uint32":  # torch computes little with uint32: as int64
        import numpy as np
        import torch

        if len(msg.inline) != 4 * math.prod(msg.shape):
            raise ValueError(f"{where}.inline: {len(msg.inline)} bytes, but shape {list(msg.shape)} of uint32")
        return torch.from_numpy(np.frombuffer(msg.inline, dtype="<u4").astype(np.int64)).reshape(tuple(msg.shape))
    return tensor_from_llmmesh(common_pb2.TensorData(data=msg.inline, dtype=msg.dtype, shape=msg.shape), where)


def mm_features_from_vllm(mm: vllm_engine_pb2.MultimodalInputs, token_ids: list[int], info, field: str) -> list:
    """One batch of a router's preprocessed images as MultiModalFeatureSpecs, split per image as its batched_keys
    and flat_keys say (any other tensor is shared by its images), each placeholder range trimmed to its image
    tokens (a router's range may take in the tokens that frame an image); ValueError naming the field at fault."""
    from engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, hash_tensors

    if mm.modality not in (smg_common_pb2.MODALITY_UNSPECIFIED, smg_common_pb2.IMAGE):
        raise ValueError(f"{field}.modality: {smg_common_pb2.Modality.Name(mm.modality)} is not supported; IMAGE is")
    if mm.HasField("encoder_input_key") and mm.encoder_input_key != "pixel_values":
        raise ValueError(f"{field}.encoder_input_key: {mm.encoder_input_key[:64]!r}; this model takes pixel_values")
    if not mm.HasField("pixel_values"):
        raise ValueError(f"{field}.pixel_values: missing (a payload without pixels is not taken here)")
    tensors = {"pixel_values": tensor_from_vllm(mm.pixel_values, f"{field}.pixel_values")}
    for key, t in mm.model_specific_tensors.items():
        tensors[key] = tensor_from_vllm(t, f"{field}.model_specific_tensors[{key[:64]!r}]")
    sizes_keys = set(mm.flat_keys.values())
    for key in tensors:
        if key not in info.data_keys and key not in sizes_keys:
            raise ValueError(
                f"{field}.model_specific_tensors[{key[:64]!r}]: not a tensor this model takes "
                f"({', '.join(info.data_keys)})"
            )
    n = len(mm.mm_placeholders)
    if mm.mm_hashes and len(mm.mm_hashes) != n:
        raise ValueError(f"{field}.mm_hashes: {len(mm.mm_hashes)} hashes for {n} placeholders")
    items = [{} for _ in range(n)]
    for key in info.data_keys:
        if key not in tensors:
            continue  # the engine's checks name what is missing
        tensor, where = tensors[key], f"{field}[{key!r}]"
        if key in mm.flat_keys:
            if mm.flat_keys[key] not in tensors:
                raise ValueError(f"{field}.flat_keys[{key!r}]: no tensor {mm.flat_keys[key][:64]!r} holds the sizes")
            sizes = tensors[mm.flat_keys[key]]
            sizes = (sizes.prod(-1) if sizes.dim() == 2 else sizes.reshape(-1)).tolist()  # a grid's rows, or sizes
            if len(sizes) != n or sum(sizes) != tensor.shape[0] or min(sizes, default=1) < 0:
                raise ValueError(f"{where}: {tensor.shape[0]} rows cannot be split as sizes {sizes} of {n} images")
            parts = tensor.split(sizes)
        elif key in mm.batched_keys:
            if tensor.dim() == 0 or tensor.shape[0] != n:
                raise ValueError(f"{where}: batched, but its first dimension is not the {n} images")
            parts = tensor.split(1)
        else:
            parts = [tensor] * n
        for item, part in zip(items, parts):
            item[key] = part
    features = []
    for i, (data, p) in enumerate(zip(items, mm.mm_placeholders)):
        start, end = p.offset, min(p.offset + p.length, len(token_ids))
        while start < end and token_ids[start] != info.image_token_id:
            start += 1
        while end > start and token_ids[end - 1] != info.image_token_id:
            end -= 1
        if start == end:
            raise ValueError(
                f"{field}.mm_placeholders[{i}]: [{p.offset}, {p.offset + p.length}) holds no image token "
                f"({info.image_token_id}) of the prompt of {len(token_ids)} tokens"
            )
        features.append(MultiModalFeatureSpec(data, hash_tensors(data), PlaceholderRange(start, end - start)))
    return features


def tokenizer_zip(model_dir: Path) -> bytes:
    """The model's tokenizer files as one zip, the way the router rebuilds a tokenizer remotely."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                zf.write(model_dir / name, name)
    return buffer.getvalue()
