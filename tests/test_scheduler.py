"""Scheduler: token budget, chunked prefill, preemption victims, watermark, abort, states."""

import random

from engine.kv.manager import KVCacheManager
from engine.request import EngineCoreEventType, Request, RequestStatus, SamplingParams
from engine.sched.output import ModelRunnerOutput
from engine.sched.scheduler import Scheduler

TOKEN = 7  # what the "model" samples; the scheduler does not care


def make_scheduler(num_blocks=1000, block_size=16, budget=2048, max_num_seqs=256, policy="fcfs", **kv):
    manager = KVCacheManager(num_blocks, block_size, **kv)
    return Scheduler(manager, budget, max_num_seqs, max_model_len=100_000, scheduling_policy=policy)


def make_request(request_id, num_tokens, max_tokens=1000, priority=0, arrival=None, start=0):
    tokens = [start + i for i in range(num_tokens)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(str(request_id), tokens, params, priority=priority, arrival_time=arrival)


def step(scheduler):
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(so, ModelRunnerOutput([[TOKEN]] * len(so.scheduled_requests)))
    check_block_accounting(scheduler.kv_cache_manager)
    return so, outputs


def check_block_accounting(manager):
    pool = manager.block_pool
    held = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert held + pool.get_num_free_blocks() == pool.num_blocks
    # Every block a request holds is referenced; nothing free is referenced.
    assert all(b.ref_cnt == 0 for b in pool.free_block_queue.get_all_free_blocks())


def test_budget_2048_with_10_decodes_chunks_3000_token_prompt_as_2038_then_962():
    s = make_scheduler()
    for i in range(10):
        s.add_request(make_request(f"d{i}", 20, start=1000 * i))
    so, _ = step(s)  # all 10 prefills fit in one step
    assert so.total_num_scheduled_tokens == 200
    s.add_request(make_request("long", 3000, start=50_000))
    so, outputs = step(s)
    assert so.num_scheduled_tokens["long"] == 2038
    assert all(so.num_scheduled_tokens[f"d{i}"] == 1 for i in range(10))
    assert "long" not in {o.request_id for o in outputs}  # a partial prefill emits nothing
    so, outputs = step(s)
    assert so.num_scheduled_tokens["long"] == 962
    assert "long" in {o.request_id for o in outputs}


def test_long_prefill_token_threshold_caps_each_chunk():
    s = make_scheduler()
    s.long_prefill_token_threshold = 100
    s.add_request(make_request("a", 250))
    assert [step(s)[0].num_scheduled_tokens["a"] for _ in range(3)] == [100, 100, 50]


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=3)
    for i in range(5):
        s.add_request(make_request(i, 4, start=100 * i))
    so, _ = step(s)
    assert len(so.scheduled_requests) == 3 and len(s.waiting) == 2


def test_fcfs_preempts_the_last_admitted_and_admits_nothing_that_step():
    # 6 blocks of 4 tokens; three requests of 8 tokens take 2 blocks each.
    s = make_scheduler(num_blocks=6, block_size=4)
    for i in range(3):
        s.add_request(make_request(i, 8, start=100 * i))
    _, outputs = step(s)
    delivered = {o.request_id: o.events for o in outputs}
    s.add_request(make_request("late", 3, start=900))
    # Each decode needs a new block now; none are free, so the youngest running request goes.
    so, _ = step(s)
    assert so.preempted_req_ids == {"2"}
    assert "late" not in so.num_scheduled_tokens  # no admissions in a preempting step
    victim = s.waiting.peek_request()
    assert victim.request_id == "2" and victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    # Events leave with the step's outputs; the preemption is queued for the next one.
    events = delivered["2"] + victim.events
    assert [e.type for e in events] == [
        EngineCoreEventType.QUEUED,
        EngineCoreEventType.SCHEDULED,
        EngineCoreEventType.PREEMPTED,
    ]
    assert events[0].timestamp <= events[1].timestamp <= events[2].timestamp
    assert s.num_preemptions == 1


def test_priority_preempts_largest_priority_then_latest_arrival():
    s = make_scheduler(num_blocks=9, block_size=4, policy="priority")
    s.add_request(make_request("urgent", 8, priority=0, arrival=1.0, start=0))
    s.add_request(make_request("low-old", 8, priority=5, arrival=2.0, start=100))
    s.add_request(make_request("low-new", 8, priority=5, arrival=3.0, start=200))
    s.add_request(make_request("mid", 8, priority=2, arrival=4.0, start=300))
    step(s)
    so, _ = step(s)
    assert so.preempted_req_ids == {"low-new"}
    assert set(so.num_scheduled_tokens) == {"urgent", "low-old", "mid"}


def test_priority_admits_in_priority_order():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("b", 4, priority=3, arrival=1.0))
    s.add_request(make_request("a", 4, priority=1, arrival=2.0, start=50))
    so, _ = step(s)
    assert [r.request_id for r in so.scheduled_requests] == ["a"]


def test_request_that_is_its_own_victim_waits():
    # One request alone grows past the pool: it preempts itself rather than evicting nothing.
    s = make_scheduler(num_blocks=2, block_size=4)
    s.add_request(make_request("solo", 8))
    step(s)
    so, _ = step(s)
    assert so.preempted_req_ids == {"solo"} and not so.scheduled_requests
    assert s.kv_cache_manager.get_num_free_blocks() == 2


def test_watermark_holds_blocks_back_from_admissions_only():
    s = make_scheduler(num_blocks=10, block_size=4, watermark=0.2)  # 2 blocks
    s.add_request(make_request("a", 24))  # 6 blocks
    step(s)
    s.add_request(make_request("b", 9, start=100))  # needs 3 blocks: 3 + 2 > 3 free after a's decode
    so, _ = step(s)
    assert "b" not in so.num_scheduled_tokens
    assert s.running[0].request_id == "a"
    # Running requests may dip into the watermark.
    for _ in range(10):
        so, _ = step(s)
        assert so.num_scheduled_tokens.get("a") == 1


def test_abort_in_any_state_frees_blocks_at_once():
    s = make_scheduler(num_blocks=20, block_size=4, budget=10)
    s.add_request(make_request("running", 8))
    s.add_request(make_request("partial", 30, start=100))
    s.add_request(make_request("waiting", 4, start=200))
    step(s)  # running fully prefilled, partial got 2 tokens, waiting has nothing
    assert s.requests["partial"].num_computed_tokens == 2
    for request_id in ["running", "partial", "waiting"]:
        s.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        check_block_accounting(s.kv_cache_manager)
    assert s.kv_cache_manager.get_num_free_blocks() == 20
    assert not s.has_unfinished_requests() and not s.requests
    so, _ = step(s)
    assert so.finished_req_ids == {"running", "partial", "waiting"}


def test_stop_conditions():
    s = make_scheduler()
    eos = Request("eos", [1, 2], SamplingParams(max_tokens=10), eos_token_ids=(TOKEN,))
    stop_id = Request("stopid", [1, 3], SamplingParams(max_tokens=10, stop_token_ids=[TOKEN]))
    min_tok = Request("min", [1, 4], SamplingParams(max_tokens=10, min_tokens=3), eos_token_ids=(TOKEN,))
    length = Request("len", [1, 5], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=(TOKEN,))
    for r in (eos, stop_id, min_tok, length):
        s.add_request(r)
    finished = {}
    while s.has_unfinished_requests():
        for o in step(s)[1]:
            if o.finished:
                finished[o.request_id] = (o.finish_reason.value, o.stop_reason, len(s.kv_cache_manager.req_to_blocks))
    assert finished["eos"][:2] == ("stop", None) and eos.num_output_tokens == 1
    assert finished["stopid"][:2] == ("stop", TOKEN)
    assert finished["min"][:2] == ("stop", None) and min_tok.num_output_tokens == 3
    assert finished["len"][:2] == ("length", None) and length.num_output_tokens == 2


def test_random_workload_keeps_accounting_and_leaks_nothing():
    rng = random.Random(0)
    s = make_scheduler(num_blocks=40, block_size=4, budget=64, max_num_seqs=8)
    for i in range(60):
        n = rng.randint(1, 40)
        # Half the prompts share a prefix so cached blocks get shared and evicted.
        start = 0 if i % 2 else 1000 * i
        s.add_request(make_request(i, n, max_tokens=rng.randint(1, 30), start=start))
    steps = 0
    while s.has_unfinished_requests():
        step(s)
        if steps % 7 == 3 and s.running:
            s.finish_requests([rng.choice(s.running).request_id], RequestStatus.FINISHED_ABORTED)
        steps += 1
        assert steps < 5000
    assert s.num_preemptions > 0
    assert not s.kv_cache_manager.req_to_blocks
    assert s.kv_cache_manager.get_num_free_blocks() == 40
    assert s.kv_cache_manager.prefix_cache_stats.hits > 0


def test_request_waiting_many_steps_counts_its_prefix_query_once():
    """A request the pool cannot take is tried on every step; its prefix-cache query is counted when it is admitted,
    with the hit it was admitted with, not once per try."""
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add_request(make_request("big", 24, max_tokens=6))  # 6 blocks, 8 as it decodes
    step(s)
    # Shares big's first 2 blocks, then 4 blocks of its own: more than the pool has free while big runs.
    waits = Request("waits", list(range(8)) + list(range(1000, 1016)), SamplingParams(max_tokens=1))
    s.add_request(waits)
    tries = 0
    while "waits" not in step(s)[0].num_scheduled_tokens:
        tries += 1
    assert tries >= 3
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (24 + 24, 8)
    assert waits.num_cached_tokens == 8
