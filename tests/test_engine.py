"""EngineCore and LLM behaviour on the real SmolLM2: refusals, abort, sampling, stop checks, events."""

import pytest

from conftest import SMOLLM2_BLOCK_BYTES, assert_no_leaks
from engine import LLM, SamplingParams
from engine.kv.block_pool import BlockStored
from engine.request import Request, RequestStatus


@pytest.fixture(scope="module")
def llm():
    # 8 blocks = 128 tokens of KV, max_model_len 100: a 110-token prompt passes the length check
    # but can never fit the pool.
    return LLM(kv_cache_memory=str(8 * SMOLLM2_BLOCK_BYTES), max_model_len=100)


def run_to_completion(engine, first_outputs=(), max_steps=500):
    """request id -> (token ids, finish reason), including tokens from `first_outputs`."""
    finished = {}
    pending = list(first_outputs)
    for _ in range(max_steps):
        if not pending and not engine.has_unfinished_requests():
            return finished
        for out in pending or engine.step():
            finished.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = (finished[out.request_id], str(out.finish_reason))
        pending = []
    raise AssertionError("engine did not finish")


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        ([1, 2, 49152], "out of vocabulary"),
        ([-1], "out of vocabulary"),
        (list(range(20, 120)), "maximum model length of 100"),
        (list(range(20, 130)), "maximum model length"),
    ],
)
def test_refused_prompt_leaves_others_running(llm, prompt, message):
    engine = llm.engine
    engine.add_request(Request("good-1", [10, 11, 12], greedy(5)))
    first = engine.step()
    with pytest.raises(ValueError, match=message):
        llm.processor.process_prompt(prompt, greedy(5))
    engine.add_request(Request("good-2", [13, 14], greedy(4)))
    finished = run_to_completion(engine, first)
    assert set(finished) == {"good-1", "good-2"}
    assert len(finished["good-1"][0]) == 5 and len(finished["good-2"][0]) == 4
    assert_no_leaks(engine)


def test_prompt_that_can_never_fit_the_pool_is_refused():
    small = LLM(kv_cache_memory=str(4 * SMOLLM2_BLOCK_BYTES), max_model_len=200)  # 64 tokens of KV
    with pytest.raises(ValueError, match="can never fit the KV cache, which holds 64 tokens"):
        small.processor.process_prompt(list(range(20, 90)), greedy(2))
    # A request that would outgrow the pool is capped at its size instead of livelocking.
    out = small.generate([list(range(20, 60))], greedy(100), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 64 - 40
    assert_no_leaks(small.engine)


def test_generate_with_a_bad_prompt_raises_and_engine_stays_clean(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["Hello", {"prompt_token_ids": []}], greedy(3), use_tqdm=False)
    assert_no_leaks(llm.engine)
    assert len(llm.generate("Hello", greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_abort_running_and_waiting_frees_blocks_in_that_step(llm):
    engine = llm.engine
    engine.add_request(Request("a", list(range(20, 50)), greedy(30)))
    engine.add_request(Request("b", list(range(60, 90)), greedy(30)))
    engine.add_request(Request("c", list(range(100, 170)), greedy(30)))  # 5 blocks: waits, 2 + 2 + 5 > 8
    first = engine.step() + engine.step()
    assert engine.scheduler.requests["a"].status == RequestStatus.RUNNING
    assert engine.scheduler.requests["c"].status == RequestStatus.WAITING
    free_before = engine.kv_cache_manager.get_num_free_blocks()
    engine.abort_requests(["a", "c", "unknown-id"])
    assert engine.kv_cache_manager.get_num_free_blocks() == free_before + 2  # a's 2 blocks
    step_outputs = engine.step()
    outputs = {o.request_id: o for o in step_outputs}
    assert str(outputs["a"].finish_reason) == "abort" and str(outputs["c"].finish_reason) == "abort"
    finished = run_to_completion(engine, first + step_outputs)
    assert finished["b"][1] == "length" and len(finished["b"][0]) == 30
    assert_no_leaks(engine)


def test_seed_gives_same_tokens_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The weather today"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.3, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["Cats are", "The weather today", "Numbers: 1, 2"], [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate(["The weather today"], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    prompt = ["A short poem about rain:"]
    reference = llm.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    for params in (
        SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=10, ignore_eos=True),
    ):
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == reference


def test_stop_token_ids_and_eos(llm):
    base = llm.generate(["Count: one, two,"], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = base[3]
    out = llm.generate(
        ["Count: one, two,"], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == base[: base.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # Chat answers end with EOS (<|im_end|>), which stops the request unless ignore_eos.
    chat = llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False
    )
    assert chat[0].outputs[0].finish_reason == "stop" and chat[0].outputs[0].token_ids[-1] == 2


def test_max_model_len_caps_generation(llm):
    out = llm.generate([list(range(20, 90))], greedy(50), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 100
    assert out.outputs[0].finish_reason == "length"


def test_metrics_and_cached_tokens(llm):
    prompt = list(range(300, 340))
    first, second = (llm.generate([prompt], greedy(4), use_tqdm=False)[0] for _ in range(2))
    m = second.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == 4 and m.time_to_first_token > 0
    assert second.num_cached_tokens == 32 and first.outputs[0].token_ids == second.outputs[0].token_ids


def test_sampling_params_validation():
    for kwargs, field in [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_kv_events_and_reset_prefix_cache():
    llm = LLM(kv_cache_memory="64MiB", enable_kv_cache_events=True)
    llm.generate([list(range(20, 60))], greedy(2), use_tqdm=False)
    events = llm.engine.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2  # 41 known tokens: 2 full blocks
    assert llm.reset_prefix_cache() is True
    assert type(llm.engine.take_kv_events()[-1]).__name__ == "AllBlocksCleared"


def test_bfloat16_runs_on_cpu():
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    assert llm.engine.worker.kv_caches[0][0].dtype.is_floating_point and str(llm.engine.dtype) == "torch.bfloat16"
    out = llm.generate(["The capital of France is"], greedy(6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and "Paris" in out.text


def test_startup_reports_blocks_and_token_capacity(caplog):
    with caplog.at_level("INFO", logger="llmmesh.engine"):
        llm = LLM(kv_cache_memory=str(10 * SMOLLM2_BLOCK_BYTES))
    assert llm.engine.num_blocks == 10
    assert "KV cache: 10 blocks of 16 tokens = 160 tokens" in caplog.text


def test_get_stats_follows_requests_through_a_run(llm):
    engine = llm.engine
    before = engine.get_stats()
    assert (before.num_running_reqs, before.num_waiting_reqs, before.kv_cache_usage, before.num_blocks) == (
        0,
        0,
        0.0,
        8,
    )
    engine.add_request(Request("a", list(range(400, 430)), greedy(3)))
    engine.add_request(Request("b", list(range(500, 530)), greedy(3)))
    assert engine.has_request("a") and not engine.has_request("zzz") and engine.num_unfinished_requests() == 2
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 2)
    first = engine.step()
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
    assert stats.kv_cache_usage == 4 / 8  # 30 tokens each: 2 blocks each
    assert stats.prefix_cache_queries - before.prefix_cache_queries == 60
    run_to_completion(engine, first)
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
    assert not engine.has_request("a") and engine.num_unfinished_requests() == 0
    # The same prompt again finds its first full block in the prefix cache.
    llm.generate([list(range(400, 430))], greedy(3), use_tqdm=False)
    assert engine.get_stats().prefix_cache_hits - stats.prefix_cache_hits == 16
    # Three requests that outgrow the 8 blocks together: preemption, counted.
    prompts = [list(range(600 + 50 * i, 640 + 50 * i)) for i in range(3)]
    llm.generate(prompts, greedy(30), use_tqdm=False)
    after = engine.get_stats()
    assert after.num_preemptions > before.num_preemptions and after.kv_cache_usage == 0.0
    assert_no_leaks(engine)


def test_fail_running_requests_frees_everything_and_emits_nothing(llm, monkeypatch):
    engine = llm.engine
    engine.add_request(Request("a", list(range(700, 731)), greedy(10)))
    engine.add_request(Request("b", list(range(800, 831)), greedy(10)))
    first = engine.step()
    engine.abort_requests(["b"])  # its abort output must survive the failed step
    engine.add_request(Request("c", list(range(900, 970)), greedy(4)))  # admitted in the failing step
    engine.add_request(Request("d", list(range(1000, 1070)), greedy(4)))  # waits: 2 + 5 + 5 > 8

    def boom(scheduler_output, while_sampling=None):
        raise RuntimeError("kernel fault")

    monkeypatch.setattr(engine.worker, "execute_model", boom)
    with pytest.raises(RuntimeError, match="kernel fault"):
        engine.step()
    assert sorted(engine.fail_running_requests()) == ["a", "c"]
    assert not engine.has_request("a") and not engine.has_request("c") and engine.has_request("d")
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 1, 0.0)
    monkeypatch.undo()

    outputs = engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["b"]  # b's abort; nothing for a or c
    finished = run_to_completion(engine, first + outputs)
    assert finished["d"][1] == "length" and "c" not in finished and not isinstance(finished["a"], tuple)
    # a's blocks left the prefix cache: the failed step had registered blocks it never wrote.
    hits = engine.get_stats().prefix_cache_hits
    llm.generate([list(range(700, 731))], greedy(2), use_tqdm=False)
    assert engine.get_stats().prefix_cache_hits == hits
    assert_no_leaks(engine)
