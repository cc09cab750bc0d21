"""Speculative decoding (n-gram and draft model) is lossless: greedy outputs equal no speculation's and Hugging
Face's, sampled outputs follow the target distribution, and blocks stay consistent under preemption and abort."""

import itertools
import json
import random
import re

import grpc
import pytest
import torch
from scipy.stats import chisquare

from conftest import (
    HFReference,
    InProcessService,
    assert_greedy_matches,
    assert_no_leaks,
    mesh_channel,
    run_to_completion,
)
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams
from engine.sample.metadata import SamplingMetadata
from engine.sample.rejection_sampler import DraftTokens, expand_positions
from engine.sample.sampler import Sampler
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram_proposer import NgramProposer
from mesh.sampler.remote import RemoteSampler
from random_model import save_random_smollm2_shaped

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,  # clear winners: greedy choices are no near-ties
)
# Six tokens, for distributions that a few thousand draws measure.
SMALL_VOCAB = {**TINY, "vocab_size": 6, "initializer_range": 0.1}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target (and its transformers twin), a smaller draft with its vocabulary, and a small-vocab pair."""
    root = tmp_path_factory.mktemp("spec")
    target = save_random_smollm2_shaped(root / "target", **TINY)
    save_random_smollm2_shaped(root / "draft", seed=1, **{**TINY, "num_hidden_layers": 1})
    small = save_random_smollm2_shaped(root / "small", seed=2, **SMALL_VOCAB)
    save_random_smollm2_shaped(root / "small-draft", seed=3, **{**SMALL_VOCAB, "num_hidden_layers": 1})
    save_random_smollm2_shaped(root / "other-vocab", seed=4, **{**TINY, "vocab_size": 96})
    return root, HFReference(target), small


def engine(model_dir, spec=None, **kwargs) -> EngineCore:
    args = dict(kv_cache_memory="4MiB", dtype="float32")
    return EngineCore(EngineArgs(model=str(model_dir), speculative_config=spec, **{**args, **kwargs}))


def specs(root):
    """No speculation, n-gram, a draft model, and the target as its own draft (every draft right)."""
    return {
        "none": None,
        "ngram": NGRAM,
        "draft_model": {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3},
        "self_draft": {"method": "draft_model", "model": str(root / "target"), "num_speculative_tokens": 3},
    }


def greedy(n, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


PROMPTS = {
    "repetitive": [3, 4, 5, 6, 7] * 3,
    "alternating": [7, 8] * 20,
    "random": random.Random(0).choices(range(3, 64), k=30),
    "short": [9, 9, 9],
}


# ---- configuration ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, named",
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must be an integer in \[1, 16\]"),
        (
            '{"method": "ngram", "num_speculative_tokens": 99}',
            r"num_speculative_tokens must be an integer in \[1, 16\]",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}',
            r"prompt_lookup_min must be an integer in \[1, 2\]",
        ),  # fmt: skip
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model is for method draft_model only"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model is required for method draft_model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', r"unknown keys \['k'\]"),
        ("[1, 2]", "must be a JSON object"),
        ("{not json", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(config, named):
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(speculative_config=config)
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.from_json(config)


def test_a_draft_with_another_vocabulary_is_refused_at_start(models):
    root, _, _ = models
    spec = {"method": "draft_model", "model": str(root / "other-vocab"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft model's vocabulary \(96 tokens\)"):
        engine(root / "target", json.dumps(spec))


def test_ngram_lookup_copies_what_followed_the_suffix():
    proposer = NgramProposer(SpeculativeConfig.from_json(NGRAM))
    assert proposer.lookup([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6, 1]  # k = 4
    assert proposer.lookup([1, 2, 3, 4, 5, 9, 3]) == [4, 5, 9, 3]  # the longest suffix that recurs: [3]
    assert proposer.lookup([1, 2, 3, 4]) == []  # nothing recurs
    assert proposer.lookup([5]) == []


# ---- the rejection sampler ----------------------------------------------------------------------------------------


def rejection(logits, requests, drafts, generators=None):
    rows = expand_positions(requests, drafts)
    md = SamplingMetadata.from_requests(rows, generators or {}, logits.shape[-1], torch.device("cpu"))
    return Sampler()(logits.clone(), md, drafts)


def test_greedy_keeps_exactly_the_targets_argmax():
    """Drafts are kept while each is the argmax; the first mismatch is replaced by the argmax, and after all kept
    comes the bonus argmax."""
    torch.manual_seed(0)
    logits = torch.randn(9, 10)
    top = logits.argmax(dim=-1).tolist()
    requests = [Request(str(i), [1], greedy(10)) for i in range(3)]
    drafts = DraftTokens([[top[0], top[1], (top[2] + 1) % 10], [top[4], top[5]], [(top[7] + 1) % 10]])
    out = rejection(logits, requests, drafts)
    assert out.sampled_token_ids.tolist() == [
        [top[0], top[1], top[2], -1],
        [top[4], top[5], top[6], -1],
        [top[7], -1, -1, -1],
    ]


def first_tokens(p_rows, q=None, num_draws=20_000):
    """num_draws requests with one draft each, drawn from q (None: the draft is token 3, q one-hot), their positions'
    targets p_rows: each one's draft and tokens (unseeded draws from the global generator, seeded here)."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0)
    requests = [Request(str(i), [1], params) for i in range(num_draws)]
    logits = torch.stack(p_rows).log().repeat(num_draws, 1)
    drafts = torch.full((num_draws,), 3) if q is None else torch.multinomial(q, num_draws, replacement=True)
    probs = None if q is None else q.repeat(num_draws, 1)
    token_ids = [[d] for d in drafts.tolist()]
    return drafts, rejection(logits, requests, DraftTokens(token_ids, probs)).sampled_token_ids


def assert_draws_from(tokens: torch.Tensor, p: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = p.double() / p.double().sum() * counts.sum()
    assert chisquare(counts, expected).pvalue > 1e-3


@pytest.mark.parametrize("one_hot", [True, False])
def test_kept_and_drawn_tokens_follow_the_target_distribution(one_hot):
    """Position 0's token is a draw from p_0, whatever the draft proposed; where the draft was kept, the next token is
    a draw from p_1 (chi-square, fixed seeds). A draft is kept with probability min(1, p/q)."""
    p0 = torch.tensor([0.1, 0.5, 0.15, 0.25])
    p1 = torch.tensor([0.4, 0.1, 0.3, 0.2])
    q = None if one_hot else torch.tensor([0.05, 0.05, 0.2, 0.7])  # the draft model's distribution
    drafts, out = first_tokens([p0, p1], q)
    first = out[:, 0]
    assert_draws_from(first, p0)
    kept = out[:, 1] != -1
    assert torch.equal(first[kept], drafts[kept])
    assert_draws_from(out[kept, 1], p1)
    q = torch.nn.functional.one_hot(torch.tensor(3), 4).float() if q is None else q
    assert abs(kept.double().mean().item() - torch.minimum(p0, q).sum().item()) < 0.01


# ---- greedy: token-identical --------------------------------------------------------------------------------------


def generate(core, prompts, params):
    requests = [Request(str(i), p, params) for i, p in enumerate(prompts)]
    tokens, ends = run_to_completion(core, requests)
    return [tokens.get(str(i), []) for i in range(len(prompts))], ends


@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_draft"])
def test_greedy_equals_no_speculation_and_transformers(models, method):
    root, hf, _ = models
    core = engine(root / "target", json.dumps(specs(root)[method]))
    prompts = list(PROMPTS.values())
    ours, _ = generate(core, prompts, greedy(48))
    for name, prompt, tokens in zip(PROMPTS, prompts, ours):
        reference, logits = hf.greedy(prompt, 48)
        assert assert_greedy_matches(tokens, reference, logits, f"{method} {name}")
    stats = core.get_stats().spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    if method == "self_draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # its own drafts are its own argmax
    if method == "ngram":
        assert stats.num_accepted_tokens > 0


def test_tp2_with_ngram_drafts_equals_tp1_without(models):
    """N-gram drafts reach every rank in the SchedulerOutput and rank 0 verifies them: two ranks with drafts give
    one rank's greedy output without them, and leak no block."""
    root, _, _ = models
    prompts = list(PROMPTS.values())
    outputs = {}
    for size, spec in ((1, None), (2, json.dumps(NGRAM))):
        core = engine(root / "target", spec, tensor_parallel_size=size, max_num_batched_tokens=32)
        try:
            outputs[size], _ = generate(core, prompts, greedy(32))
            if spec is not None:
                stats = core.get_stats().spec_decoding_stats
                assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts kept and drafts cut
            assert_no_leaks(core)
        finally:
            core.shutdown()
    assert outputs[2] == outputs[1] and all(len(tokens) == 32 for tokens in outputs[1])


def test_stop_tokens_and_max_tokens_among_accepted_drafts(models):
    """A stop token among a step's accepted tokens ends the request there, max_tokens is honoured exactly, and
    logprobs come for exactly the tokens sent, equal to those without speculation."""
    root, _, _ = models
    prompts = list(PROMPTS.values())
    base, _ = generate(engine(root / "target"), prompts, greedy(40))
    stop = base[0][20]  # a token several steps in
    outputs = {}
    for method in ("none", "self_draft"):
        spec = specs(root)[method]
        core = engine(root / "target", json.dumps(spec) if spec else None)
        requests = [Request(f"{i}", p, greedy(37, stop_token_ids=[stop], logprobs=2)) for i, p in enumerate(prompts)]
        for request in requests:
            core.add_request(request)
        got = {}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens, logprobs, _ = got.setdefault(out.request_id, ([], [], None))
                tokens += out.new_token_ids
                if out.new_logprobs is not None:
                    assert len(out.new_logprobs.token_ids) == len(out.new_token_ids)
                    logprobs.append(out.new_logprobs.logprobs)
                if out.finished:
                    got[out.request_id] = (tokens, logprobs, out.finish_reason)
        assert_no_leaks(core)
        outputs[method] = got
    for request_id, (tokens, logprobs, reason) in outputs["none"].items():
        spec_tokens, spec_logprobs, spec_reason = outputs["self_draft"][request_id]
        assert spec_tokens == tokens and spec_reason == reason
        assert torch.allclose(torch.cat(spec_logprobs), torch.cat(logprobs), atol=1e-4)
    assert outputs["none"]["0"][0][-1] == stop and len(outputs["none"]["0"][0]) == 21


def test_preemption_and_abort_mid_speculation_leak_no_block(models):
    """A pool too small for the batch preempts requests that hold drafts; outputs stay those without speculation
    and every block comes back. Aborts between steps, with drafts pending, free everything too."""
    root, _, _ = models
    prompts = [PROMPTS["repetitive"] * 2, PROMPTS["alternating"], PROMPTS["random"], PROMPTS["repetitive"]]
    block_bytes = 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * 16 * 4
    expected, _ = generate(engine(root / "target"), prompts, greedy(48))
    for method in ("ngram", "draft_model"):
        spec = specs(root)[method]
        draft_share = 2 if method == "draft_model" else 1  # the draft's KV pays its share of each block
        core = engine(root / "target", json.dumps(spec), kv_cache_memory=str(14 * block_bytes * draft_share))
        ours, _ = generate(core, prompts, greedy(48))
        assert ours == expected, method
        assert core.scheduler.num_preemptions > 0, method
        for i, prompt in enumerate(prompts):
            core.add_request(Request(f"abort-{i}", prompt, greedy(64)))
        for _ in range(6):
            core.step()
        assert any(r.spec_token_ids for r in core.scheduler.running)
        core.abort_requests([f"abort-{i}" for i in range(len(prompts))])
        while core.has_unfinished_requests():
            core.step()
        assert_no_leaks(core)


def test_n_prompt_logprobs_chunked_prefill_and_a_kv_connector_keep_working(models, tmp_path):
    """n completions, prompt logprobs, prompts chunked over steps and a KV connector that stores and loads prompt
    blocks (never a draft's): outputs equal those without speculation."""
    from engine import LLM

    root, _, _ = models
    store = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}
    params = [
        SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2, logprobs=1),
        SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=24, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": PROMPTS["repetitive"] * 3}, {"prompt_token_ids": PROMPTS["random"]}]
    results = {}
    for name in ("none", "ngram", "draft_model"):
        spec = specs(root)[name]
        config = {**store, "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / name)}}
        llm = LLM(
            str(root / "target"),
            kv_cache_memory="4MiB",
            dtype="float32",
            max_num_batched_tokens=16,  # the 45-token prompt runs in three chunks
            speculative_config=spec,
            kv_transfer_config=json.dumps(config),
        )
        first = llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()  # the second run loads the prompts' blocks from the store
        second = llm.generate(prompts, params, use_tqdm=False)
        greedy_out = [c.token_ids for c in first[0].outputs]
        assert greedy_out == [c.token_ids for c in second[0].outputs] and greedy_out[0] == greedy_out[1], name
        seeded = [[c.token_ids for c in first[1].outputs], [c.token_ids for c in second[1].outputs]]
        assert len({tuple(t) for t in seeded[0]}) == 3, name  # the n completions differ
        # A seed repeats its tokens without speculation; with it, only under the same schedule: a draft the token
        # budget cuts changes which draws verify a position (so do vLLM's).
        assert name != "none" or seeded[0] == seeded[1]
        assert any(event == "kv_loaded" for _, event, _ in second[1].metrics.kv_transfers), name
        prompt_logprobs = [list(p.values())[0].logprob for p in first[0].prompt_logprobs[1:]]
        results[name] = (
            greedy_out[0],
            prompt_logprobs,
            [list(lp.values())[0].logprob for lp in first[0].outputs[0].logprobs],
        )
        llm.engine.shutdown()
    for name in ("ngram", "draft_model"):
        assert results[name][0] == results["none"][0], name
        assert results[name][1] == pytest.approx(results["none"][1], abs=1e-5), name
        assert results[name][2] == pytest.approx(results["none"][2], abs=1e-4), name


# ---- sampled: the target distribution -----------------------------------------------------------------------------


def exact_distribution(hf_model, prompt, length):
    """P(t_1 .. t_length | prompt) for every sequence of the small vocabulary, from transformers' logits."""
    vocab = hf_model.config.vocab_size
    sequences = list(itertools.product(range(vocab), repeat=length))
    ids = torch.tensor([prompt + list(s[:-1]) for s in sequences])
    with torch.inference_mode():
        logprobs = hf_model(ids).logits.float().log_softmax(dim=-1)
    n = len(prompt)
    targets = torch.tensor(sequences)
    picked = logprobs[:, n - 1 : n - 1 + length].gather(2, targets.unsqueeze(2)).squeeze(2)
    return {s: p for s, p in zip(sequences, picked.sum(dim=1).exp().tolist())}


def test_sampled_sequences_follow_the_target_distribution(models):
    """Three sampled tokens (temperature 1; the engine seeds its generator) counted over a small vocabulary and compared with the
    exact distribution by a chi-square test: without speculation, with n-gram drafts (q one-hot) and with a draft
    model (a real q). Cells expected fewer than 5 times are pooled."""
    root, _, small = models
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 2]
    exact = exact_distribution(small, prompt, 3)
    num_draws = 1500
    configs = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
        "draft_model": {"method": "draft_model", "model": str(root / "small-draft"), "num_speculative_tokens": 2},
    }
    for name, spec in configs.items():
        core = engine(root / "small", json.dumps(spec) if spec else None, max_num_seqs=256)
        params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)] * num_draws
        tokens, _ = run_to_completion(core, [Request(str(i), prompt, p) for i, p in enumerate(params)])
        counts = {s: 0 for s in exact}
        for t in tokens.values():
            counts[tuple(t[:3])] += 1
        if spec is not None:
            assert core.get_stats().spec_decoding_stats.num_accepted_tokens > num_draws // 4, name
        observed, expected, pooled = [], [], [0, 0.0]
        for s, p in exact.items():
            if p * num_draws < 5:
                pooled[0] += counts[s]
                pooled[1] += p * num_draws
            else:
                observed.append(counts[s])
                expected.append(p * num_draws)
        observed.append(pooled[0])
        expected.append(pooled[1])
        expected = [e * num_draws / sum(expected) for e in expected]  # float32's sum is 1 to 1e-7
        assert chisquare(observed, expected).pvalue > 1e-3, name


def test_seeded_requests_repeat(models):
    root, _, _ = models
    for method in ("ngram", "draft_model"):
        runs = []
        for _ in range(2):
            core = engine(root / "target", json.dumps(specs(root)[method]))
            params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=7)
            tokens, _ = generate(core, [PROMPTS["repetitive"], PROMPTS["random"]], params)
            runs.append(tokens)
        assert runs[0] == runs[1], method


# ---- the sampler service ------------------------------------------------------------------------------------------


def test_the_sampler_service_gives_the_same_tokens(models):
    """Drafts (and a draft model's q) travel with the step: greedy, seeded and penalised requests with logprobs get
    the same tokens and logprobs on the sampler service as in process."""
    root, _, _ = models
    params = [
        greedy(32, logprobs=3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.7, top_k=8, seed=6, presence_penalty=0.5, max_tokens=32, ignore_eos=True),
    ]
    prompts = [PROMPTS["repetitive"], PROMPTS["alternating"], PROMPTS["random"]]

    def run(core):
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            core.add_request(Request(str(i), prompt, p))
        tokens, logprobs = {}, {}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    logprobs.setdefault(out.request_id, []).append(out.new_logprobs.logprobs)
        assert_no_leaks(core)
        return tokens, {k: torch.cat(v) for k, v in logprobs.items()}

    for method in ("ngram", "draft_model"):
        spec = json.dumps(specs(root)[method])
        local_tokens, local_logprobs = run(engine(root / "target", spec))
        core = engine(root / "target", spec)
        runner = core.worker.model_runner
        with InProcessService("sampler") as sampler:
            runner.sampler = RemoteSampler(sampler.address, timeout=30)
            try:
                remote_tokens, remote_logprobs = run(core)
            finally:
                runner.sampler.close()
        assert remote_tokens == local_tokens, method
        assert local_logprobs.keys() == remote_logprobs.keys()
        for key, value in local_logprobs.items():
            assert torch.equal(remote_logprobs[key], value), method
        assert core.get_stats().spec_decoding_stats.num_accepted_tokens > 0


def wire_step(**fields):
    """A step of request "a" (greedy) with two drafts: three rows of logits over a vocabulary of 8."""
    from llmmesh.v1 import sampler_pb2
    from mesh.sampler.wire import tensor_to_proto

    good = dict(
        step_id=1,
        new_requests=[sampler_pb2.NewRequest(request_id="a", params=sampler_pb2.SamplerParams(temperature=0))],
        request_ids=["a"],
        num_new_tokens=[0],
        logits=tensor_to_proto(torch.eye(8)[[7, 3, 5]] * 4),  # argmax 7, then 3, then 5
        num_draft_tokens=[2],
        draft_token_ids=[7, 4],
    )
    return sampler_pb2.SampleStep(**{**good, **fields})


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(num_draft_tokens=[3]), "num_draft_tokens"),
        (dict(num_draft_tokens=[2, 0]), "num_draft_tokens must have one entry per request_ids"),
        (dict(num_draft_tokens=[-1], draft_token_ids=[]), "num_draft_tokens"),
        (dict(num_draft_tokens=[2], draft_token_ids=[7, 99]), "draft_token_ids"),
        (dict(num_draft_tokens=[1], draft_token_ids=[7]), "logits.shape"),
        (dict(num_draft_tokens=[]), "draft_token_ids and draft_probs need num_draft_tokens"),
    ],
)
def test_bad_drafts_on_the_wire_are_invalid_argument_naming_the_field(fields, named):
    from llmmesh.v1 import sampler_pb2_grpc

    with InProcessService("sampler") as sampler, mesh_channel(sampler.address) as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Sample(iter([wire_step(**fields)]), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert named in info.value.details()
        # The service goes on: the good step keeps draft 7 (the argmax), rejects 4 and gives the argmax 3.
        (reply,) = stub.Sample(iter([wire_step()]), timeout=30)
        assert list(reply.sampled_token_ids) == [7, 3] and list(reply.num_sampled_tokens) == [2]


# ---- structured output --------------------------------------------------------------------------------------------


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_with_smollm2_tokenizer(tmp_path_factory, smollm2_dir):
    """A tiny random model over SmolLM2's vocabulary and tokenizer: grammars need real token strings."""
    path = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    save_random_smollm2_shaped(path, **{**TINY, "vocab_size": 49152})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((smollm2_dir / name).read_bytes())
    return path


def test_structured_output_with_speculation_equals_structured_output_alone(tiny_with_smollm2_tokenizer):
    """The grammar masks every verified position; drafts it rejects are cut; the matcher ends on exactly the
    accepted tokens. Greedy outputs equal those without speculation, sampled ones follow their grammar."""
    import jsonschema

    from engine import LLM, StructuredOutputsParams

    model = str(tiny_with_smollm2_tokenizer)

    def constrained(temperature=0.0, **constraint):
        return SamplingParams(
            temperature=temperature,
            seed=3,
            max_tokens=64,
            structured_outputs=StructuredOutputsParams(**constraint, disable_any_whitespace=True),
        )

    batch = [
        ('A person named "Ada Ada Ada", as JSON:', constrained(json=SCHEMA)),
        ("Repeat: 555-1234, 555-1234, 555-1234. The number is", constrained(regex=r"\d{3}-\d{4}")),
        ('The tags "a", "a", "a" as JSON:', constrained(0.8, json=SCHEMA)),
    ]
    outputs = {}
    # The target as its own draft: long runs of accepted drafts through the grammar, and drafts it cuts.
    for name, spec in [
        ("none", None),
        ("self_draft", {"method": "draft_model", "model": model, "num_speculative_tokens": 3}),
    ]:
        llm = LLM(model=model, dtype="float32", kv_cache_memory="16MiB", speculative_config=spec)
        results = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
        outputs[name] = [r.outputs[0] for r in results]
        person, phone, sampled = (o.text for o in outputs[name])
        jsonschema.validate(json.loads(person), SCHEMA)
        jsonschema.validate(json.loads(sampled), SCHEMA)
        assert re.fullmatch(r"\d{3}-\d{4}", phone), phone
        assert all(o.finish_reason == "stop" for o in outputs[name])
        if spec is not None:
            assert llm.engine.get_stats().spec_decoding_stats.num_accepted_tokens > 0, name
        llm.engine.shutdown()
    assert [o.token_ids for o in outputs["self_draft"][:2]] == [o.token_ids for o in outputs["none"][:2]]


# ---- metrics ------------------------------------------------------------------------------------------------------


def test_the_engines_metrics_count_drafts_as_vllm_names_them(models):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    root, _, _ = models
    flags = ["--model", root / "target", "--kv-cache-memory", "4MiB", "--metrics-port", "0"]
    flags += ["--speculative-config", json.dumps(specs(root)["self_draft"])]
    with InProcessService("engine", flags) as service, mesh_channel(service.address) as channel:
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        request = engine_pb2.EngineGenerateRequest(
            request_id="r", prompt_token_ids=PROMPTS["random"], sampling_params=params
        )
        tokens = [t for msg in engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60)
                  for delta in msg.outputs for t in delta.token_ids]  # fmt: skip
        url = f"http://127.0.0.1:{service.server.telemetry.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    assert len(tokens) == 20

    def value(name, **labels):
        return sum(s.value for s in families[name].samples if labels.items() <= s.labels.items())

    drafts = value("vllm:spec_decode_num_drafts")
    # 20 tokens: the first from the prompt's step, then steps of up to 1 + 3 tokens, every draft accepted.
    assert drafts == 5 and value("vllm:spec_decode_num_draft_tokens") == value("vllm:spec_decode_num_accepted_tokens")
    assert value("vllm:spec_decode_num_accepted_tokens") == 19 - drafts
    per_pos = [value("vllm:spec_decode_num_accepted_tokens_per_pos", position=str(i)) for i in range(3)]
    assert sum(per_pos) == value("vllm:spec_decode_num_accepted_tokens") and per_pos[0] == drafts
