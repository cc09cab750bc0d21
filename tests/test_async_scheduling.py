"""Async scheduling (--async-scheduling): the next step's blocks are allocated, and a step of decodes has its
inputs prepared, while a step's tokens are being sampled (on the sampler service, or in process), and the
outputs are token for token those of an engine that waits for them:
greedy and seeded requests, logprobs, under preemption and chunked prefill, with aborts, stop tokens, min_tokens
and max_tokens, and through the mesh with the detokenizer's stop strings."""

import random
from collections import Counter

import pytest

from conftest import InProcessService, assert_no_leaks
from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import FinishReason, Request
from mesh.sampler.remote import RemoteSampler
from services.client import collect, generate
from services.local_mesh import Mesh
from test_models import COMMON

BLOCK_BYTES = 2 * COMMON["num_hidden_layers"] * 16 * COMMON["num_key_value_heads"] * 16 * 4  # float32, 16 tokens
# Each request's sampling: greedy and seeded draws, penalties, logprobs, stops, min_tokens, max_tokens.
PARAMS = [
    dict(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3),
    dict(temperature=0.9, top_p=0.9, seed=1, max_tokens=36),
    dict(temperature=1.1, top_k=50, seed=2, max_tokens=30, repetition_penalty=1.2, frequency_penalty=0.3),
    dict(temperature=0.8, seed=3, max_tokens=44, ignore_eos=True, stop_token_ids=[55, 56]),
    dict(temperature=0, max_tokens=12, min_tokens=10, ignore_eos=True, prompt_logprobs=2),
    dict(temperature=1.0, seed=4, max_tokens=48, ignore_eos=True, logprobs=1),
]


@pytest.fixture(scope="module")
def sampler():
    with InProcessService("sampler") as service:
        yield service


def run(tiny_llama_dir, sampler, async_scheduling: bool, abort_at_step: int | None = None, remote: bool = True):
    """Twelve requests on a 16-block KV cache in 32-token steps, sampled on the service (shared memory) or in
    process: each request's tokens, logprobs and ending, the preemptions, the steps whose blocks were allocated
    ahead, and those that ran on inputs prepared ahead."""
    args = EngineArgs(
        model=str(tiny_llama_dir),
        kv_cache_memory=str(16 * BLOCK_BYTES),
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    core = EngineCore(args)
    runner = core.worker.model_runner
    if remote:
        runner.sampler = RemoteSampler(sampler.address, slot_bytes=args.max_num_seqs * COMMON["vocab_size"] * 4)
    rng = random.Random(0)
    for i in range(12):
        prompt = rng.choices(range(3, COMMON["vocab_size"]), k=rng.randint(8, 60))
        core.add_request(Request(str(i), prompt, SamplingParams(**PARAMS[i % len(PARAMS)]), eos_token_ids=(2,)))
    results: dict[str, list] = {}
    steps_ahead = 0
    try:
        while core.has_unfinished_requests():
            for out in core.step():
                tokens, logprobs, ends = results.setdefault(out.request_id, [[], [], []])
                tokens += out.new_token_ids
                if out.new_logprobs is not None:
                    logprobs.append((out.new_logprobs.token_ids.tolist(), out.new_logprobs.logprobs.tolist()))
                if out.new_prompt_logprobs is not None:
                    logprobs.append(out.new_prompt_logprobs.logprobs.tolist())
                if out.finished:
                    ends.append((out.finish_reason, out.stop_reason))
            steps_ahead += bool(core.scheduler.allocated_ahead)
            if core.num_steps == abort_at_step:  # one running request, one that waits, one not yet seen
                core.abort_requests([r.request_id for r in core.scheduler.running[:1]] + ["11", "no-such"])
        assert not remote or runner.sampler.slots is not None  # the logits went through shared memory
        assert_no_leaks(core)
        return results, core.get_stats().num_preemptions, (steps_ahead, runner.num_prepared_ahead)
    finally:
        runner.sampler.close()
        core.shutdown()


@pytest.mark.parametrize("abort_at_step", [None, 9])
def test_outputs_equal_without_async_scheduling(tiny_llama_dir, sampler, abort_at_step):
    want, want_preemptions, none_ahead = run(tiny_llama_dir, sampler, False, abort_at_step)
    got, preemptions, (steps_ahead, prepared_ahead) = run(tiny_llama_dir, sampler, True, abort_at_step)
    assert got == want
    assert preemptions == want_preemptions > 0
    assert none_ahead == (0, 0) and steps_ahead > 10 and prepared_ahead > 5
    # In process too (the sampler's while_waiting runs after its sampling there).
    got, preemptions, (_, prepared_ahead) = run(tiny_llama_dir, sampler, True, abort_at_step, remote=False)
    assert got == want and preemptions == want_preemptions and prepared_ahead > 5
    # The run exercised what it claims to.
    ends = Counter(reason for _, _, [(reason, _)] in want.values())
    assert ends[FinishReason.STOP] > 0 and ends[FinishReason.LENGTH] > 0
    assert ends[FinishReason.ABORT] == (0 if abort_at_step is None else 2)


def test_the_mesh_with_stop_strings_gives_the_offline_engines_text(tiny_llama_dir):
    """The engine schedules ahead while the sampler service samples; the detokenizer's stop strings make the
    gateway abort requests whose next steps are already allocated. The text is the offline engine's, which
    samples in process and waits for every step's tokens."""
    rng = random.Random(1)
    prompts = [" ".join(f"<{t}>" for t in rng.choices(range(3, 512), k=rng.randint(5, 40))) for _ in range(4)]
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB", async_scheduling=False)
    seeded = dict(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**seeded), use_tqdm=False)]
    # A stop string from the middle of each text: the stop really ends it early.
    stops = [[" ".join(text.split()[10:12])] for text in plain]
    want = [
        llm.generate(p, SamplingParams(**seeded, stop=s), use_tqdm=False)[0].outputs[0].text
        for p, s in zip(prompts, stops)
    ]
    assert all(len(w) < len(t) for w, t in zip(want, plain))
    with Mesh(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="4MiB"), sampler=True) as mesh:
        for prompt, stop, text in zip(prompts, stops, want):
            assert collect(generate(mesh.address, prompt, stop=stop, **seeded)).text() == text
