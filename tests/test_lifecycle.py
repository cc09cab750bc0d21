"""The one request lifecycle (engine/output_processor.py) and the request limits, without a model."""

import math

import pytest

from engine.limits import RequestLimits
from engine.output_processor import OutputProcessor, RequestOutputKind, RequestState
from engine.processor import child_request_id
from engine.request import EngineCoreEvent, EngineCoreEventType, FinishReason, SamplingParams
from engine.sched.output import EngineCoreOutput


def out(request_id, tokens, finish=None, stop_reason=None, events=()):
    return EngineCoreOutput(request_id, tokens, finish, stop_reason, events=list(events))


def test_delta_outputs_hold_only_what_moved_and_report_a_finish_once():
    params = SamplingParams(n=2, max_tokens=4, detokenize=False)
    processor = OutputProcessor(tokenizer=None)
    state = processor.add_request("r", None, [1, 2, 3], params, output_kind=RequestOutputKind.DELTA)
    ids = [r.request_id for r in state.engine_requests]
    assert ids == [child_request_id(0, "r"), child_request_id(1, "r")]
    assert [r.sampling_params.n for r in state.engine_requests] == [1, 1]

    (first,), _ = processor.process_outputs([out(ids[0], [7]), out(ids[1], [8])])
    assert [(c.index, c.token_ids) for c in first.outputs] == [(0, [7]), (1, [8])]
    (second,), _ = processor.process_outputs([out(ids[1], [9], FinishReason.LENGTH)])
    assert [(c.index, c.token_ids, c.finish_reason) for c in second.outputs] == [(1, [9], "length")]
    assert not second.finished
    (last,), _ = processor.process_outputs([out(ids[0], [5], FinishReason.STOP, 5)])
    assert [(c.index, c.token_ids, c.finish_reason, c.stop_reason) for c in last.outputs] == [(0, [5], "stop", 5)]
    assert last.finished and not processor.has_unfinished_requests()
    # A late output (an abort racing the finish) is dropped.
    assert processor.process_outputs([out(ids[0], [], FinishReason.ABORT)]) == ([], [])


def test_final_only_gives_one_whole_output_with_metrics():
    processor = OutputProcessor(tokenizer=None)
    state = processor.add_request("r", None, [1], SamplingParams(max_tokens=3, detokenize=False), arrival_time=10.0)
    rid = state.engine_requests[0].request_id
    scheduled = EngineCoreEvent(EngineCoreEventType.SCHEDULED, 10.5)
    preempted = EngineCoreEvent(EngineCoreEventType.PREEMPTED, 10.6)
    assert processor.process_outputs([out(rid, [4], events=[scheduled])], now=11.0) == ([], [])
    assert processor.process_outputs([out(rid, [], events=[preempted])], now=11.5) == ([], [])
    (final,), _ = processor.process_outputs([out(rid, [5, 6], FinishReason.LENGTH)], now=12.0)
    m = final.metrics
    assert final.outputs[0].token_ids == [4, 5, 6]
    assert (m.time_in_queue, m.time_to_first_token, m.e2e_latency) == (0.5, 1.0, 2.0)
    assert m.num_preemptions == 1 and m.num_generation_tokens == 3 and m.last_token_time == 12.0


def test_stop_string_from_elsewhere_ends_one_completion_and_names_its_engine_request():
    # The gateway's use: text and stop strings come from the detokenizer service.
    state = RequestState("g", None, [1], SamplingParams(n=3, stop=["x"]), output_kind=RequestOutputKind.DELTA)
    c0, c1, c2 = state.completions
    state.add_tokens(c1, [3, 4], None)
    assert state.stop_at_string(c1, "x", engine_finished=False) == child_request_id(1, "g")
    assert c1.finish_reason == "stop" and c1.stop_reason == "x"
    assert state.unfinished_engine_ids() == [child_request_id(0, "g"), child_request_id(2, "g")]
    assert state.stop_at_string(c0, "x", engine_finished=True) is None  # the engine had finished it already
    state.finish(c2, FinishReason.LENGTH)
    assert state.finished and state.metrics.finished_time is not None


def test_a_request_id_that_clashes_with_a_running_child_is_refused():
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("r", None, [1], SamplingParams(n=2, detokenize=False))
    with pytest.raises(ValueError, match="request_id"):
        processor.add_request("r", None, [1], SamplingParams(detokenize=False))
    with pytest.raises(ValueError, match="clashes"):
        processor.add_request(child_request_id(1, "r"), None, [1], SamplingParams(detokenize=False))


def test_children_are_not_verified_again_and_keep_vllm_seeds():
    processor = OutputProcessor(tokenizer=None)
    state = processor.add_request("r", None, [1], SamplingParams(n=3, seed=7, prompt_logprobs=2, detokenize=False))
    assert [r.sampling_params.seed for r in state.engine_requests] == [7, 8, 9]
    assert [r.sampling_params.prompt_logprobs for r in state.engine_requests] == [2, None, None]


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 129),
        ("stop", ["s"] * 65),
        ("stop", ["s" * 1025]),
        ("stop_token_ids", list(range(1025))),
        ("bad_words", ["w"] * 1025),
        ("logit_bias", {i: 1.0 for i in range(1025)}),
        ("allowed_token_ids", list(range(65537))),
    ],
)
def test_limits_name_the_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=rf"^{field}"):
        RequestLimits().check_params(params)


def test_max_tokens_is_capped_by_the_model_length():
    RequestLimits().check_params(SamplingParams(max_tokens=100), max_model_len=100)
    with pytest.raises(ValueError, match="^max_tokens"):
        RequestLimits().check_params(SamplingParams(max_tokens=101), max_model_len=100)


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number"):
        SamplingParams(**{field: value})


def test_non_finite_logit_bias_is_refused_not_clamped():
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={5: math.nan})
    assert SamplingParams(logit_bias={5: 1e9}).logit_bias == {5: 100.0}


def test_each_delta_output_keeps_its_own_token_times():
    """A consumer that reads an output after the next step's has been made (the engine thread runs ahead of the
    event loop) still sees that output's own last token time: inter-token latencies are counted from them."""
    processor = OutputProcessor(tokenizer=None)
    state = processor.add_request(
        "r",
        None,
        [1],
        SamplingParams(max_tokens=3, detokenize=False),
        arrival_time=10.0,
        output_kind=RequestOutputKind.DELTA,
    )
    rid = state.engine_requests[0].request_id
    (first,), _ = processor.process_outputs([out(rid, [4])], now=11.0)
    (second,), _ = processor.process_outputs([out(rid, [5])], now=11.25)
    (last,), _ = processor.process_outputs([out(rid, [6], FinishReason.LENGTH)], now=11.75)
    times = [o.metrics.last_token_time for o in (first, second, last)]
    assert times == [11.0, 11.25, 11.75]
    assert [o.metrics.num_generation_tokens for o in (first, second, last)] == [1, 2, 3]
    assert first.metrics.finished_time is None and last.metrics.e2e_latency == 1.75
