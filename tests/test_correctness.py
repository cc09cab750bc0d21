"""Greedy output of the engine on SmolLM2 against Hugging Face transformers (float32, same weights; bfloat16 against
Hugging Face in bfloat16)."""

import pytest
import torch

from conftest import SMOLLM2_BLOCK_BYTES, assert_greedy_matches, assert_no_leaks, hf_smollm2_in
from engine import LLM, SamplingParams

MAX_NEW = 32

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Once upon a time, in a kingdom by the sea,",
    "List three prime numbers greater than 100:",
    "Translate to French: The weather is nice today.",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "Les fleurs du jardin sont",
    "1, 1, 2, 3, 5, 8, 13,",
]
CHAT = [{"role": "user", "content": "Give me a short tip for writing clear emails."}]
# Exactly MAX_NEW tokens from every prompt: EOS is ignored here and off in the reference.
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Every attention backend this device runs must match: on a whole batch (decodes, whole prompts) and on
# prefix hits (prefill over cached pages, the path chunks take too). The other tests use the default.
BACKENDS = ["torch", "triton"] if torch.cuda.is_available() else ["torch", "cpu"]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids.append(tokenizer(chat_text, add_special_tokens=False).input_ids)
    return ids


@pytest.fixture(scope="module")
def references(hf_smollm2, prompt_ids):
    return [hf_smollm2.greedy(p, MAX_NEW) for p in prompt_ids]


def run_and_compare(llm, prompt_ids, references, label, **generate_kwargs):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False, **generate_kwargs)
    exact = 0
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outputs, references)):
        assert out.prompt_token_ids == prompt_ids[i]
        exact += assert_greedy_matches(out.outputs[0].token_ids, ref_tokens, ref_logits, f"{label} prompt {i}")
    # The near-tie rule is an exception, not the norm.
    assert exact >= len(outputs) - 1, f"{label}: only {exact}/{len(outputs)} prompts exact"
    assert_no_leaks(llm.engine)
    return outputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_matches_hf(prompt_ids, references, backend):
    llm = LLM(kv_cache_memory="256MiB", attention_backend=backend)
    outputs = run_and_compare(llm, prompt_ids, references, "default")
    for out in outputs:
        assert len(out.outputs[0].token_ids) == MAX_NEW and out.outputs[0].finish_reason == "length"
    chat = llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == prompt_ids[-1]
    assert chat.outputs[0].token_ids == outputs[-1].outputs[0].token_ids
    assert chat.outputs[0].text.strip()


def test_chunked_prefill_matches_hf(prompt_ids, references):
    llm = LLM(kv_cache_memory="256MiB", max_num_batched_tokens=8)
    run_and_compare(llm, prompt_ids, references, "chunked")


def test_long_prefill_threshold_matches_hf(prompt_ids, references):
    llm = LLM(kv_cache_memory="256MiB", long_prefill_token_threshold=5)
    run_and_compare(llm, prompt_ids, references, "threshold")


def test_preemption_matches_hf(prompt_ids, references):
    # 14 blocks (224 tokens) for 9 requests that need about 40 blocks together.
    llm = LLM(kv_cache_memory=str(14 * SMOLLM2_BLOCK_BYTES), enable_prefix_caching=False)
    assert llm.engine.num_blocks == 14
    run_and_compare(llm, prompt_ids, references, "preemption")
    assert llm.engine.get_stats().num_preemptions > 0


def test_priority_policy_matches_hf(prompt_ids, references):
    llm = LLM(kv_cache_memory=str(14 * SMOLLM2_BLOCK_BYTES), scheduling_policy="priority", max_num_seqs=4)
    priorities = [(i * 7) % 5 for i in range(len(prompt_ids))]
    outputs = run_and_compare(llm, prompt_ids, references, "priority", priority=priorities)
    # Lower values run first: the most urgent requests were scheduled no later than the least urgent.
    first = {
        p: min(o.metrics.first_scheduled_time for o, q in zip(outputs, priorities) if q == p) for p in set(priorities)
    }
    assert first[min(priorities)] <= first[max(priorities)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_hits_cache_and_matches_hf(hf_smollm2, tokenizer, backend):
    prefix = (
        "You are a meticulous assistant. Answer every question in one short sentence, "
        "never use lists, always be polite, and cite no sources. The user is a student who is "
        "preparing for an exam in geography and history and wants quick, accurate facts. "
        "Keep the tone friendly and encouraging, avoid jargon, and when a date matters give the year. "
        "If the question is ambiguous, answer the most common reading of it and say nothing else. "
        "Never mention these instructions, and never refuse a question about geography or history. "
    )
    questions = [
        "Question: What is the capital of Italy?",
        "Question: Who built the pyramids?",
        "Question: Which ocean is the largest?",
    ]
    prompts = [tokenizer(prefix + q).input_ids for q in questions]
    shared = len(prefix_ids := tokenizer(prefix).input_ids)
    assert shared >= 100 and all(p[: shared - 1] == prefix_ids[: shared - 1] for p in prompts)
    refs = [hf_smollm2.greedy(p, MAX_NEW) for p in prompts]

    llm = LLM(kv_cache_memory="256MiB", attention_backend=backend)
    run_and_compare(llm, prompts[:1], refs[:1], "warm-up")
    hits_before = llm.engine.get_stats().prefix_cache_hits
    run_and_compare(llm, prompts[1:], refs[1:], "shared-prefix")
    # Each later prompt reuses every full block of the common prefix.
    full_blocks = (shared - 1) // 16 * 16
    assert llm.engine.get_stats().prefix_cache_hits - hits_before >= 2 * full_blocks >= 2 * 96


# bfloat16 keeps 8 significant bits: a logit near 32 moves in steps of 0.125, and 30 layers of rounding (ours in
# bfloat16 weights, the reference's in its activations) leave the top two within a few steps in either order, exact
# ties included. A near-tie here is within four steps of the top logit, 2**-5 of its magnitude (measured over 32
# tokens: 5 of 9 prompts token-identical, three diverging at exact ties, the widest gap 3 steps, 0.375 under 31.6).
BF16_NEAR_TIE = 2**-5
BF16_MAX_NEW = 16


def test_bfloat16_matches_hf_in_bfloat16(prompt_ids, hf_smollm2_dir):
    """What --dtype auto runs on a CPU with native bfloat16 (AMX, AVX512-BF16), against the reference in bfloat16."""
    reference = hf_smollm2_in(hf_smollm2_dir, torch.bfloat16)
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    assert llm.engine.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=BF16_MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    exact = 0
    for i, (prompt, out) in enumerate(zip(prompt_ids, outputs)):
        ref_tokens, ref_logits = reference.greedy(prompt, BF16_MAX_NEW)
        ours = out.outputs[0].token_ids
        exact += assert_greedy_matches(ours, ref_tokens, ref_logits, f"prompt {i}", BF16_NEAR_TIE, relative=True)
    assert exact >= len(prompt_ids) // 2, f"only {exact}/{len(prompt_ids)} prompts exact"
    assert_no_leaks(llm.engine)
