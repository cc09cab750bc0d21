"""The checks every model family's tests share, each called with (tmp_path, a transformers config object of a tiny
model): the engine against Hugging Face on the same random weights, through the engine's paths that touch the model
(chunked prefill, prefix-cache hits, preemption, structured output, n-gram speculation, tensor parallelism 2, LoRA,
and the KV store).

The model is saved once per tmp_path and config (save_family_model); its 1-D weights (norms, biases) are drawn at
random too, so a layer that skipped one would show. Its tokenizer maps id i to the word "<i>".
"""

import json

import torch

from conftest import (
    HFReference,
    assert_greedy_matches,
    assert_no_leaks,
    loading_kv_config,
    run_greedy,
    run_to_completion,
)
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams, StructuredOutputsParams
from random_model import save_word_level_tokenizer

BLOCK = 8
MAX_TOKENS = 16


def save_family_model(tmp_path, config, seed: int = 0):
    """The model's directory and its transformers twin (float32, eval), saved under tmp_path once per config."""
    import transformers

    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    cache = _saved.setdefault(str(tmp_path), {})
    if key in cache:
        return cache[key]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms about 1, biases about 0: visible, but the activations stay of one scale
                param.copy_(torch.randn_like(param) * 0.3 + (0.0 if name.endswith("bias") else 1.0))
    path = tmp_path / f"{type(config).__name__}-{len(cache)}"
    model.save_pretrained(path)
    save_word_level_tokenizer(path, config.vocab_size)
    cache[key] = (path, model)
    return cache[key]


_saved: dict[str, dict] = {}


def prompts(config, lengths=(5, 19, 45)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def make_engine(path, **kwargs) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), **{"kv_cache_memory": "8MiB", "block_size": BLOCK, **kwargs}))


def block_bytes(config) -> int:
    """One float32 KV block of this model: K and V of every layer (with multi-head latent attention, one latent
    vector a token and layer)."""
    if getattr(config, "kv_lora_rank", None):
        return config.num_hidden_layers * BLOCK * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * BLOCK * config.num_key_value_heads * head_dim * 4


def assert_matches_hf(hf_model, prompt_list, outputs, label):
    reference = HFReference(hf_model)
    for i, (prompt, ours) in enumerate(zip(prompt_list, outputs)):
        ref_tokens, ref_logits = reference.greedy(prompt, len(ours))
        assert assert_greedy_matches(ours, ref_tokens, ref_logits, f"{label} prompt {i}")


def check_greedy_chunked_and_prefix_cached(tmp_path, config, **engine_kwargs):
    """Greedy output equals Hugging Face's with prompts prefilled in chunks of a small token budget, and again for a
    prompt whose first blocks come from the prefix cache."""
    path, hf_model = save_family_model(tmp_path, config)
    engine = make_engine(path, max_num_batched_tokens=16, **engine_kwargs)
    first = prompts(config)
    assert_matches_hf(hf_model, first, run_greedy(engine, first, MAX_TOKENS), "chunked prefill")
    hits = engine.get_stats().prefix_cache_hits
    shared = [first[2][:32] + first[0]]  # four full blocks of the 45-token prompt's
    assert_matches_hf(hf_model, shared, run_greedy(engine, shared, MAX_TOKENS), "prefix-cache hit")
    assert engine.get_stats().prefix_cache_hits - hits == 32
    assert_no_leaks(engine)


def check_preemption(tmp_path, config, **engine_kwargs):
    """A pool of 12 blocks for three requests that need 7 each: requests are preempted and recomputed, and every
    output still equals Hugging Face's."""
    path, hf_model = save_family_model(tmp_path, config)
    engine = make_engine(path, kv_cache_memory=str(12 * block_bytes(config)), **engine_kwargs)
    batch = prompts(config, (30, 30, 30))
    outputs = run_greedy(engine, batch, 24)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf(hf_model, batch, outputs, "preempted")
    assert_no_leaks(engine)


def check_structured_output(tmp_path, config, **engine_kwargs):
    """A regex request yields exactly what the regex allows, then stops at EOS: over the "<i>" words (no JSON can be
    made of them), three tokens of "<30>" to "<99>"."""
    path, _ = save_family_model(tmp_path, config)
    engine = make_engine(path, **engine_kwargs)
    constraint = StructuredOutputsParams(regex=r"(<[3-9][0-9]>){3}")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=constraint)
    tokens, ends = run_to_completion(engine, [Request("regex", prompts(config)[1], params)])
    assert all(30 <= t <= 99 for t in tokens["regex"][:3]), tokens
    assert tokens["regex"][3:] == [config.eos_token_id] and ends["regex"].finish_reason == "stop", tokens


def check_ngram_speculation(tmp_path, config, **engine_kwargs):
    """N-gram drafts (prompts that repeat themselves, so drafts are proposed and some kept) leave greedy output
    token-identical to Hugging Face's."""
    path, hf_model = save_family_model(tmp_path, config)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = make_engine(path, speculative_config=json.dumps(spec), **engine_kwargs)
    batch = [p * 3 for p in prompts(config, (4, 7))]
    assert_matches_hf(hf_model, batch, run_greedy(engine, batch, MAX_TOKENS), "ngram speculation")
    assert engine.get_stats().spec_decoding_stats.num_draft_tokens > 0
    assert_no_leaks(engine)


def check_tensor_parallel(tmp_path, config, **engine_kwargs):
    """Two ranks (heads and KV heads split between them) give Hugging Face's greedy output."""
    path, hf_model = save_family_model(tmp_path, config)
    engine = make_engine(path, tensor_parallel_size=2, max_num_batched_tokens=16, **engine_kwargs)
    try:
        batch = prompts(config)
        assert_matches_hf(hf_model, batch, run_greedy(engine, batch, MAX_TOKENS), "tensor parallel 2")
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def check_lora(tmp_path, config, target_modules, rank: int = 4, **engine_kwargs):
    """A random PEFT adapter on target_modules gives the output of Hugging Face's model with it merged, and changes
    the output (it is really applied)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from engine.lora.request import LoRARequest

    path, hf_model = save_family_model(tmp_path, config)
    torch.manual_seed(1)
    lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(hf_model), lora_config)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    merged = peft_model.merge_and_unload().eval()
    engine = make_engine(path, enable_lora=True, max_loras=1, max_lora_rank=rank, **engine_kwargs)
    try:
        batch = prompts(config)
        lora_request = LoRARequest("adapter", 1, str(adapter))
        assert engine.add_lora(lora_request)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        requests = [Request(str(i), p, params, lora_request=lora_request) for i, p in enumerate(batch)]
        tokens, _ = run_to_completion(engine, requests)
        ours = [tokens[str(i)] for i in range(len(batch))]
        assert_matches_hf(merged, batch, ours, f"LoRA on {target_modules}")
        assert ours != run_greedy(engine, batch, MAX_TOKENS)
    finally:
        engine.shutdown()  # its tensor-parallel ranks, where it has them


def check_kv_store(tmp_path, config, redis_url: str, **engine_kwargs):
    """An engine stores its prompts' blocks in the kvstore (on a real redis-server); a second engine, its prefix
    cache empty, loads them and gives Hugging Face's output."""
    from conftest import InProcessService

    path, hf_model = save_family_model(tmp_path, config)
    batch = prompts(config)
    with InProcessService("kvstore", ["--redis-url", redis_url]) as kvstore:
        kv_config = loading_kv_config(kvstore.address)
        for role in ("stores", "loads"):
            engine = make_engine(path, kv_transfer_config=kv_config, **engine_kwargs)
            try:
                assert_matches_hf(hf_model, batch, run_greedy(engine, batch, MAX_TOKENS), f"engine that {role}")
                while engine.has_unfinished_requests():  # until every store has ended
                    engine.step()
                stats = engine.get_stats().kv_connector_stats
                assert_no_leaks(engine)
            finally:
                engine.shutdown()
        full_blocks = sum((len(p) - 1) // BLOCK for p in batch)
        assert stats["loaded_tokens"] == full_blocks * BLOCK and stats["load_failed_tokens"] == 0


def check_engine_paths(tmp_path, config, redis_url: str, lora_targets, **engine_kwargs):
    """Every check above but the first, on one model: a family's tests call this with the config that exercises most
    of it, and check_greedy_chunked_and_prefix_cached with each variant."""
    check_preemption(tmp_path, config, **engine_kwargs)
    check_structured_output(tmp_path, config, **engine_kwargs)
    check_ngram_speculation(tmp_path, config, **engine_kwargs)
    check_tensor_parallel(tmp_path, config, **engine_kwargs)
    check_lora(tmp_path, config, lora_targets, **engine_kwargs)
    check_kv_store(tmp_path, config, redis_url, **engine_kwargs)
