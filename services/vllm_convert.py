"""vLLM's VllmEngine messages (from the pinned `smg-grpc-proto` package) <-> the engine library's Python types.

vLLM's servicer conventions are followed: proto3 zeros read as "unset" where vLLM reads them so, a streamed
chunk carries its own step's token count, and block hashes travel as int64.
"""

from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2

from engine.kv.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from engine.outputs import RequestOutput
from engine.request import SamplingParams, StructuredOutputsParams


def sampling_params_from_vllm(msg: vllm_engine_pb2.SamplingParams) -> SamplingParams:
    """vLLM's servicer reading of proto3 zeros: top_p 0 and repetition_penalty 0 mean "unset", n 0 means 1,
    no max_tokens means up to the model's length. A bad value raises ValueError naming the field."""
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
        structured_outputs=structured_outputs_from_vllm(msg),
    )


def structured_outputs_from_vllm(msg: vllm_engine_pb2.SamplingParams) -> StructuredOutputsParams | None:
    """The request's constraint (smg's response_format and tool-call constraints arrive here); None without one."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    # json_schema is StructuredOutputsParams' json; the other fields have its names.
    return StructuredOutputsParams(**{"json" if kind == "json_schema" else kind: value})


def _top(entry: dict, num_top: int) -> tuple[list[int], list[float]]:
    """The top num_top of one position's {token_id: Logprob}, by rank."""
    top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top)
    return [t for _, t, _ in top], [v for _, _, v in top]


def output_logprobs_to_vllm(positions: list[dict], num_top: int) -> vllm_engine_pb2.OutputLogProbs:
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


def input_logprobs_to_vllm(prompt_ids: list[int], positions: list, num_top: int) -> vllm_engine_pb2.InputLogProbs:
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


def kv_events_to_vllm(seq: int, timestamp: float, events: list, load=None) -> smg_common_pb2.KvEventBatch:
    batch = smg_common_pb2.KvEventBatch(sequence_number=seq, timestamp=timestamp, dp_rank=0)
    for event in events:
        if isinstance(event, BlockStored):
            medium = event.medium if event.loaded_from is None else f"{event.medium};loaded_from={event.loaded_from}"
            stored = smg_common_pb2.KvBlocksStored(tier=KV_TIERS[event.medium], medium=medium, group_idx=event.group_id)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = block_hash_to_int64(event.parent_block_hash)
            for i, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                stored.blocks.add(
                    block_hash=block_hash_to_int64(block_hash), token_ids=tokens, block_size=event.block_size
                )
            batch.events.add(stored=stored)
        elif isinstance(event, BlockRemoved):
            removed = smg_common_pb2.KvBlocksRemoved(
                block_hashes=[block_hash_to_int64(h) for h in event.block_hashes], group_idx=event.group_id
            )
            batch.events.add(removed=removed)
        elif isinstance(event, AllBlocksCleared):
            batch.events.add(cleared=smg_common_pb2.KvCacheCleared())
    if load is not None:
        batch.load.CopyFrom(load)
    return batch


def request_output_to_vllm(out: RequestOutput, streaming: bool, num_logprobs: int, num_prompt_logprobs: int):
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
                chunk.output_logprobs.CopyFrom(output_logprobs_to_vllm(c.logprobs, num_logprobs))
            if out.prompt_logprobs and c.index == 0:  # once, with the first token of completion 0
                chunk.input_logprobs.CopyFrom(
                    input_logprobs_to_vllm(prompt_ids, out.prompt_logprobs, num_prompt_logprobs)
                )
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
                complete.output_logprobs.CopyFrom(output_logprobs_to_vllm(c.logprobs, num_logprobs))
            if out.prompt_logprobs is not None and c.index == 0:
                complete.input_logprobs.CopyFrom(
                    input_logprobs_to_vllm(prompt_ids, out.prompt_logprobs, num_prompt_logprobs)
                )
        yield vllm_engine_pb2.GenerateResponse(complete=complete)
