"""Sampling parameters end to end on the real SmolLM2: logprobs against transformers, n > 1,
stop strings ending the request in the engine, min_tokens, logit_bias, allowed/bad tokens,
penalties, truncation and validation."""

import pytest
import torch

from conftest import assert_greedy_matches, assert_no_leaks
from engine import LLM, SamplingParams

TOL = 1e-4
EOS = 2


@pytest.fixture(scope="module")
def llm():
    # A 32-token budget chunks every prompt longer than 32 tokens, prompt logprobs included.
    return LLM(kv_cache_memory="256MiB", max_num_batched_tokens=32)


def chat_ids(llm, text):
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def hf_logprobs(hf, ids):
    """log_softmax of transformers' float32 logits at every position of `ids`."""
    with torch.inference_mode():
        return hf.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_entry(entry, token_id, ref_row, k):
    """One position's {token: Logprob} against the reference row: values, ranks, k or k+1 entries."""
    ids = list(entry)
    assert ids[0] == token_id
    top = ref_row.topk(k)
    in_top = token_id in top.indices.tolist()
    assert len(entry) == (k if in_top else k + 1)
    for token, lp in entry.items():
        assert abs(lp.logprob - ref_row[token].item()) < TOL, (token, lp.logprob, ref_row[token].item())
        assert lp.decoded_token is not None
    assert entry[token_id].rank == int((ref_row >= ref_row[token_id]).sum())
    # The top k: the reference's best k values, ranked 1..k.
    ours = sorted((lp.logprob for t, lp in entry.items() if t != token_id or in_top), reverse=True)
    assert torch.allclose(torch.tensor(ours), top.values, atol=TOL)
    assert sorted(lp.rank for t, lp in entry.items() if t != token_id or in_top) == list(range(1, k + 1))


@pytest.mark.parametrize("prompt_len", [12, 75])  # one step, and chunked over three
def test_logprobs_and_prompt_logprobs_match_transformers(llm, hf_smollm2, prompt_len):
    poem = "Write a short poem about the sea, the wind, the gulls, the fishing boats coming home at dusk, " * 2
    prompt = chat_ids(llm, poem)[:prompt_len]
    assert len(prompt) == prompt_len
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ref = hf_logprobs(hf_smollm2, prompt + completion.token_ids)

    assert len(completion.logprobs) == 6
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        check_entry(entry, token, ref[prompt_len - 1 + j], 5)
    expected_sum = sum(ref[prompt_len - 1 + j, t].item() for j, t in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=1e-3)

    assert len(out.prompt_logprobs) == prompt_len and out.prompt_logprobs[0] is None
    for i in range(1, prompt_len):
        check_entry(out.prompt_logprobs[i], prompt[i], ref[i - 1], 3)
    assert_no_leaks(llm.engine)


def test_sampled_token_outside_top_k_gets_k_plus_one_entries(llm, hf_smollm2):
    prompt = chat_ids(llm, "What is the capital of France?")
    forced = 7592  # an ordinary token the model would not pick here
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, logit_bias={forced: 100}, ignore_eos=True)
    completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == [forced] * 3
    ref = hf_logprobs(hf_smollm2, prompt + completion.token_ids)
    for j, entry in enumerate(completion.logprobs):
        # Logprobs are of the raw logits: the bias that forced the token is not in them.
        check_entry(entry, forced, ref[len(prompt) - 1 + j], 2)
        assert len(entry) == 3 and entry[forced].rank > 2


def test_whole_vocabulary_logprobs_when_the_limit_allows():
    llm = LLM(kv_cache_memory="64MiB", max_logprobs=-1)
    out = llm.generate([[20, 30, 40, 50]], SamplingParams(temperature=0, max_tokens=2, logprobs=-1), use_tqdm=False)
    entries = out[0].outputs[0].logprobs
    assert [len(e) for e in entries] == [49152, 49152]
    total = torch.tensor([lp.logprob for lp in entries[0].values()]).logsumexp(0)
    assert abs(total.item()) < 1e-3  # a full distribution


def test_n_completions_share_one_prefill(llm):
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks that can be shared
    llm.reset_prefix_cache()
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    queries, hits = stats.queries, stats.hits
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    # The first sequence computes the prompt; the other three find its 32 full-block tokens cached.
    assert stats.queries - queries == 4 * 40
    assert stats.hits - hits == 3 * 32
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Sequence i draws as a lone request with seed 7 + i would.
    for c in out.outputs:
        alone = SamplingParams(seed=7 + c.index, temperature=1.0, max_tokens=8, ignore_eos=True)
        assert llm.generate({"prompt_token_ids": prompt}, alone, use_tqdm=False)[0].outputs[0].token_ids == c.token_ids
    assert_no_leaks(llm.engine)


def token_end_offsets(tokenizer, ids):
    return [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]


def pick_stop_string(tokenizer, ids, text):
    """A 4-character piece of the text that starts inside one token and ends inside a later one."""
    ends = token_end_offsets(tokenizer, ids)
    for i in range(2, len(ids) - 2):
        a = ends[i] - 2
        stop = text[a : a + 4]
        if ends[i + 1] > a + 2 and text.find(stop) == a and stop.strip() and "\ufffd" not in stop:
            completing = next(j for j, e in enumerate(ends) if e >= a + 4)
            if completing > i:
                return stop, a, completing
    raise AssertionError("no stop string found that spans two tokens")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_request_in_the_engine(llm, include):
    prompt = chat_ids(llm, "List five fruits, one per line.")
    base = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    base_ids, base_text = base[0].outputs[0].token_ids, base[0].outputs[0].text
    stop, at, completing = pick_stop_string(llm.tokenizer, base_ids, base_text)

    # Drive the engine by hand to see it stop in the very step the stop string shows up.
    engine, processor = llm.engine, llm.output_processor
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=include)
    for request in processor.add_request("stop-test", None, prompt, params).engine_requests:
        engine.add_request(request)
    finished, steps = [], 0
    while not finished:
        finished, reqs_to_abort = processor.process_outputs(engine.step())
        engine.abort_requests(reqs_to_abort)
        steps += 1
    assert reqs_to_abort == ["stop-test"]  # ended by the stop string, not by the engine's own checks
    assert_no_leaks(engine)  # before any further step: its blocks are already back in the pool
    completion = finished[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == base_ids[: completing + 1]
    assert completion.text == base_text[: at + len(stop) if include else at]
    assert processor.process_outputs(engine.step()) == ([], [])  # the abort's own output is stale: ignored
    assert not processor.has_unfinished_requests()


def test_min_tokens_keeps_eos_away(llm):
    prompt = chat_ids(llm, "Say hi.")
    short = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    short = short[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == EOS  # it stops on its own
    n = len(short.token_ids) + 10
    params = SamplingParams(temperature=0, max_tokens=n + 20, min_tokens=n)
    longer = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n and EOS not in longer.token_ids[:n]


def test_logit_bias_allowed_tokens_and_bad_words(llm):
    prompt = chat_ids(llm, "What is the capital of France?")
    forced = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.7, seed=3, max_tokens=4, logit_bias={4113: 100}),
        use_tqdm=False,
    )
    assert forced[0].outputs[0].token_ids == [4113] * 4

    allowed = [330, 4113, 7592]
    params = SamplingParams(temperature=1.5, seed=5, max_tokens=12, allowed_token_ids=allowed, ignore_eos=True)
    tokens = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) == 12 and set(tokens) <= set(allowed)

    base = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in base[0].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris"])
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text
    for banned in params.bad_words_token_ids:
        n = len(banned)
        assert all(out.token_ids[i : i + n] != banned for i in range(len(out.token_ids)))


def test_repetition_penalty_matches_transformers(llm, hf_smollm2):
    prompt = chat_ids(llm, "Repeat the word apple ten times.")
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = hf_smollm2.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ref_tokens = ref.sequences[0, len(prompt) :].tolist()
    plain = (
        llm.generate(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert plain != ref_tokens  # the penalty changes the output, so matching it means something
    assert_greedy_matches(ours, ref_tokens, torch.stack([s[0] for s in ref.scores]), "repetition_penalty")


def test_one_token_prompt_has_one_empty_prompt_logprob(llm):
    out = llm.generate([[42]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_truncate_prompt_tokens_keeps_the_end(llm):
    prompt = list(range(500, 550))
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, truncate_prompt_tokens=10), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == prompt[-10:]


def test_detokenize_off_and_special_tokens_kept(llm):
    prompt = chat_ids(llm, "Say hi.")
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, detokenize=False), use_tqdm=False
    )[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 5
    params = SamplingParams(temperature=0, max_tokens=3, skip_special_tokens=False, logit_bias={1: 100})
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [1, 1, 1] and out.text == "<|im_start|>" * 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logprobs": 21}, "logprobs must be at most --max-logprobs=20"),
        ({"prompt_logprobs": 25}, "prompt_logprobs must be at most --max-logprobs=20"),
        ({"logprobs": -1}, "logprobs must be at most --max-logprobs=20"),
        ({"logit_bias": {49152: 1.0}}, r"logit_bias token ids must be in \[0, 49152\)"),
        ({"allowed_token_ids": [5, -1]}, r"allowed_token_ids token ids must be in \[0, 49152\)"),
        ({"stop_token_ids": [60000]}, r"stop_token_ids token ids must be in \[0, 49152\)"),
    ],
)
def test_model_dependent_validation_leaves_engine_untouched(llm, kwargs, message):
    good = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=message):
        llm.generate([[20, 21], [22, 23]], [good, SamplingParams(max_tokens=2, **kwargs)], use_tqdm=False)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be non-negative"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be -1 or 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"n": 0}, "n must be at least 1"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal to max_tokens=2"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than 0"),
        ({"logprobs": -2}, "logprobs must be non-negative, or -1"),
        ({"prompt_logprobs": -5}, "prompt_logprobs must be non-negative, or -1"),
        ({"stop": ["ok", ""]}, "stop must be non-empty strings"),
        ({"stop": "x", "detokenize": False}, "stop needs detokenize=True"),
        ({"bad_words": [""]}, "bad_words must be non-empty strings"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be at least 1, or -1"),
        ({"logit_bias": {"a": 1}}, "logit_bias must map token ids"),
    ],
)
def test_sampling_params_validation_names_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalisation():
    params = SamplingParams(stop="END", top_k=-1, logit_bias={"7": 500.0, 8: -500})
    assert params.stop == ["END"] and params.top_k == 0 and params.logit_bias == {7: 100.0, 8: -100.0}
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
