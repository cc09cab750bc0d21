"""Batch invariance beyond the dense single-rank model, on tiny random models in bfloat16: mixture-of-experts
(Mixtral, Qwen2-MoE), multi-head latent attention (DeepSeek-V2) and tensor parallelism 3. A request's tokens, and the
logprob of each, are bit for bit those it gets alone, cold and one step per token, among neighbours, in chunks and on
a prefix-cache hit; and the latent-attention kernel's rows alone and in a batch."""

import itertools

import families
import torch
from test_deepseek import DEEPSEEK_V2, VARIANTS
from test_mixtral import SHAPE as MIXTRAL
from test_qwen_moe import QWEN2_MOE

from engine.core import EngineCore
from engine.request import Request, SamplingParams
from test_models import COMMON

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
_ids = itertools.count()


def run(engine: EngineCore, requests: list[tuple[list[int], str | None]]) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt, cache salt or None for one of its own) requests added together: each one's tokens and logprobs."""
    ids = []
    for prompt, salt in requests:
        ids.append(f"r{next(_ids)}")
        engine.add_request(Request(ids[-1], prompt, PARAMS, cache_salt=salt or f"cold-{next(_ids)}"))
    tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id].append(out.new_logprobs.logprobs[:, 0])
    return [(tokens[i], torch.cat(logprobs[i])) for i in ids]


def assert_same(outputs, reference, label):
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, reference, strict=True)):
        assert tokens == ref_tokens, f"{label}, prompt {i}"
        assert torch.equal(logprobs, ref_logprobs), f"{label}, prompt {i}: logprobs differ"


def check_invariance(tmp_path, config, **engine_kwargs):
    path, _ = families.save_family_model(tmp_path, config)
    prompts = families.prompts(config, (5, 19, 40))

    def engine(**kwargs):
        return families.make_engine(path, dtype="bfloat16", **engine_kwargs, **kwargs)

    one_token = engine(max_num_batched_tokens=1, enable_prefix_caching=False)
    try:
        reference = [run(one_token, [(p, None)])[0] for p in prompts]
    finally:
        one_token.shutdown()
    chunked = engine(max_num_batched_tokens=16)  # chunks of 16 tokens beside the other requests' decodes
    try:
        neighbours = [(p[::-1], None) for p in prompts]
        assert_same(run(chunked, [(p, None) for p in prompts] + neighbours)[:3], reference, "chunked, in a batch")
        hits = chunked.get_stats().prefix_cache_hits
        again = run(chunked, [(p, None) for p in prompts[1:]] + [(prompts[2], "hit"), (prompts[2], None)])
        assert_same(again[:2], reference[1:], "chunked, in another batch")
        assert_same([run(chunked, [(prompts[2], "hit")])[0]], reference[2:], "prefix-cache hit")
        assert chunked.get_stats().prefix_cache_hits - hits >= 32
    finally:
        chunked.shutdown()
    whole = engine(max_num_batched_tokens=256)  # each prompt in one step, all of them together
    try:
        assert_same(run(whole, [(p, None) for p in prompts] + neighbours)[:3], reference, "whole, in a batch")
    finally:
        whole.shutdown()


def test_mixtral_is_batch_invariant(tmp_path):
    import transformers

    check_invariance(tmp_path, transformers.MixtralConfig(**MIXTRAL))


def test_qwen2_moe_is_batch_invariant(tmp_path):
    import transformers

    check_invariance(tmp_path, transformers.Qwen2MoeConfig(**QWEN2_MOE))


def test_deepseek_v2_mla_is_batch_invariant(tmp_path):
    import transformers

    check_invariance(tmp_path, transformers.DeepseekV2Config(**{**DEEPSEEK_V2, **VARIANTS["q-lora-group-limited"]}))


def test_tensor_parallel_3_is_batch_invariant(tmp_path):
    """Three ranks' partial products are summed in rank order (gathered, not gloo's ring), the same for every step:
    invariant within the size."""
    import transformers

    shape = dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)
    check_invariance(tmp_path, transformers.LlamaConfig(**{**COMMON, **shape}), tensor_parallel_size=3)


def test_mla_decode_row_is_the_same_alone_and_in_a_batch():
    """A row of the latent-attention kernel over 600 keys (parts of 256 at fixed places) gives bit for bit the same
    output alone as beside seven others; its part split does not follow the batch."""
    from kernels.cpu_ops import load

    mla_decode = load().mla_decode
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, heads, head_size, rank = 16, 48, 4, 40, 32
    cache = torch.randn(num_blocks, block_size, head_size, generator=gen).bfloat16()
    query = torch.randn(8, heads, head_size, generator=gen).bfloat16()
    seq_lens = torch.tensor([600, 5, 300, 40, 257, 1, 512, 100])
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:38] for _ in range(8)])
    together = mla_decode(query, cache, seq_lens, tables, rank, 0.2)
    for r in range(8):
        alone = mla_decode(query[r : r + 1], cache, seq_lens[r : r + 1], tables[r : r + 1], rank, 0.2)
        assert torch.equal(alone[0], together[r]), f"row {r}"
