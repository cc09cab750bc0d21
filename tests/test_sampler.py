"""The batched sampler against definitions written out here: distributions, seeds, processors, logprobs."""

import dataclasses
import math
import random

import pytest
import torch
from scipy.stats import chisquare

from engine.request import Request, SamplingParams, StructuredOutputsParams
from engine.sample.metadata import GrammarBitmask, MetadataCache, SamplingMetadata, argmax_only
from engine.sample.sampler import Sampler, apply_logits_processors, compute_logprobs, gather_logprobs

INF = float("inf")

# Shuffled so that the most likely tokens are not the first ids.
LOGITS = [0.3, 2.0, -1.5, 1.2, 0.0, -0.4, 1.5, -3.0, 0.7, -0.9, 1.0, -2.0]
VOCAB = len(LOGITS)


def make_request(prompt=(1, 2, 3), output=(), eos=(0,), params=None, **kwargs) -> Request:
    request = Request("r", list(prompt), params or SamplingParams(**kwargs), eos_token_ids=eos)
    for token in output:
        request.append_output_token_ids(token)
    return request


def metadata(requests, vocab, generators=None, device="cpu"):
    return SamplingMetadata.from_requests(requests, generators or {}, vocab, torch.device(device))


def run_sampler(logits, requests, generators=None):
    return Sampler()(logits.clone(), metadata(requests, logits.size(1), generators))


# --- distributions ------------------------------------------------------------------------------


def target_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The distribution a request asks for, from the definitions: temperature, min-p, top-k, top-p."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    keep = range(len(logits))
    if min_p > 0:
        # Probability relative to the most likely token: the normalisation cancels.
        keep = [i for i in keep if weights[i] >= min_p]
    keep = sorted(keep, key=lambda i: -scaled[i])
    if top_k > 0:
        keep = keep[:top_k]
    if top_p < 1.0:
        total = sum(weights[i] for i in keep)
        nucleus, mass = [], 0.0
        for i in keep:
            if mass >= top_p:
                break
            assert abs(mass - top_p) > 1e-3, "test logits too close to a top-p boundary"
            nucleus.append(i)
            mass += weights[i] / total
        keep = nucleus
    total = sum(weights[i] for i in keep)
    return [weights[i] / total if i in keep else 0.0 for i in range(len(logits))]


CASES = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=4),
    dict(top_p=0.8),
    dict(temperature=0.9, min_p=0.15),
    dict(temperature=1.5, top_k=6, top_p=0.85, min_p=0.05),
    dict(temperature=0.6, top_k=3, top_p=0.9),
    dict(temperature=1.2, top_p=0.7, min_p=0.02),
]
DRAWS = 20_000


@pytest.fixture(scope="module")
def mixed_draws():
    """DRAWS tokens for each case, all cases interleaved row by row in one sampler call.

    Greedy rows are mixed in too, so the random rows' settings must find their rows among others.
    """
    torch.manual_seed(0)
    kinds = [SamplingParams(**case) for case in CASES] + [SamplingParams(temperature=0)]
    requests = [make_request(params=kinds[i % len(kinds)]) for i in range(DRAWS * len(kinds))]
    logits = torch.tensor(LOGITS).repeat(len(requests), 1)
    tokens = run_sampler(logits, requests).sampled_token_ids
    assert (tokens[len(CASES) :: len(kinds)] == LOGITS.index(max(LOGITS))).all()
    return [torch.bincount(tokens[c :: len(kinds)], minlength=VOCAB).tolist() for c in range(len(CASES))]


def chi_square_p(counts: list[int], target: list[float]) -> float:
    support = [i for i, p in enumerate(target) if p > 0]
    return chisquare([counts[i] for i in support], [sum(counts) * target[i] for i in support]).pvalue


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_draws_follow_the_target_distribution(mixed_draws, case):
    counts, target = mixed_draws[case], target_distribution(LOGITS, **CASES[case])
    outside = [i for i in range(VOCAB) if target[i] == 0 and counts[i] > 0]
    assert not outside, f"drew tokens outside the allowed set: {outside}"
    assert chi_square_p(counts, target) > 1e-3


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_chi_square_rejects_a_wrong_target(mixed_draws, case):
    # The same case with its temperature 20% off: the test above must be able to tell.
    wrong = dict(CASES[case], temperature=CASES[case].get("temperature", 1.0) * 1.2)
    assert chi_square_p(mixed_draws[case], target_distribution(LOGITS, **wrong)) < 1e-6


def test_top_p_is_applied_after_top_k_renormalises():
    # Top-k leaves 3 tokens; top-p of their renormalised mass then keeps only the first two.
    logits = torch.log(torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10]])).repeat(4000, 1)
    requests = [make_request(top_k=3, top_p=0.7)] * len(logits)
    tokens = run_sampler(logits, requests).sampled_token_ids
    assert set(tokens.tolist()) == {0, 1}


# --- seeds --------------------------------------------------------------------------------------


def seeded_tokens(batch: list[tuple[str, SamplingParams]], steps=6, vocab=1000) -> dict[str, list[int]]:
    """name -> tokens of each seeded row of batch (name, params) over a few steps.

    A row's logits depend on its name and the step only, so a row sees the same logits wherever it sits.
    """
    generators = {row: torch.Generator().manual_seed(p.seed) for row, (_, p) in enumerate(batch) if p.seed is not None}
    tokens = {row: [] for row in generators}
    for step in range(steps):
        torch.manual_seed(1000 + step)  # for the unseeded rows: keeps the test deterministic
        logits = torch.stack(
            [torch.randn(vocab, generator=torch.Generator().manual_seed(ord(name) * 100 + step)) for name, _ in batch]
        )
        sampled = run_sampler(logits, [make_request(params=p) for _, p in batch], generators).sampled_token_ids
        for row in generators:
            tokens[row].append(int(sampled[row]))
    return {batch[row][0]: t for row, t in tokens.items()}


def test_a_seed_gives_the_same_tokens_whatever_the_batch():
    seeded = ("a", SamplingParams(seed=7, temperature=0.8))
    alone = seeded_tokens([seeded])["a"]
    batches = [
        [seeded, ("b", SamplingParams())],
        [("b", SamplingParams(temperature=0)), ("c", SamplingParams(seed=3, top_k=5)), seeded],
        [
            ("b", SamplingParams(top_p=0.5)),
            ("c", SamplingParams(seed=11, min_p=0.1)),
            ("d", SamplingParams()),
            ("e", SamplingParams(temperature=0)),
            seeded,
        ],
    ]
    for batch in batches:
        assert seeded_tokens(batch)["a"] == alone
    # And the seed matters: the same logits with another seed give other tokens.
    assert seeded_tokens([("a", SamplingParams(seed=8, temperature=0.8))])["a"] != alone


def test_seeded_rows_with_top_k_top_p_keep_their_draws_across_batches():
    seeded = ("a", SamplingParams(seed=5, top_k=50, top_p=0.9, temperature=1.2))
    alone = seeded_tokens([seeded])["a"]
    # Here the seeded row shares the top-k/top-p pass with rows of other settings.
    batch = [("b", SamplingParams(top_p=0.3)), seeded, ("c", SamplingParams(seed=9, top_k=2))]
    assert seeded_tokens(batch)["a"] == alone


# --- logits processors --------------------------------------------------------------------------


def reference_processors(logits: list[float], request: Request) -> list[float]:
    """Steps 3-5 of the sampler for one row, from the definitions, in plain Python."""
    p, out = request.sampling_params, request.output_token_ids
    logits = list(logits)
    if p.allowed_token_ids is not None:
        logits = [x if t in p.allowed_token_ids else -INF for t, x in enumerate(logits)]
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(out) and (not prefix or out[-len(prefix) :] == prefix):
            logits[word[-1]] = -INF
    if len(out) < p.min_tokens:
        for t in p.stop_token_ids + ([] if p.ignore_eos else list(request.eos_token_ids)):
            logits[t] = -INF
    for t, bias in (p.logit_bias or {}).items():
        logits[t] += bias
    seen = set(request.prompt_token_ids) | set(out)
    for t in range(len(logits)):
        x = logits[t]
        if t in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * out.count(t)
        x -= p.presence_penalty * (t in out)
        logits[t] = x
    return logits


def random_request(rng: random.Random, vocab: int, features: set[str]) -> Request:
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
    kw = {}
    if "penalties" in features:
        kind = rng.choice(["presence", "frequency", "repetition", "all"])
        if kind in ("presence", "all"):
            kw["presence_penalty"] = rng.uniform(-2, 2)
        if kind in ("frequency", "all"):
            kw["frequency_penalty"] = rng.uniform(-2, 2)
        if kind in ("repetition", "all"):
            kw["repetition_penalty"] = rng.uniform(0.5, 2)
    if "logit_bias" in features:
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(1, 5))}
    if "allowed" in features:
        kw["allowed_token_ids"] = rng.sample(range(vocab), rng.randint(1, vocab // 2))
    if "min_tokens" in features:
        kw["min_tokens"] = rng.randint(0, 16)
        kw["stop_token_ids"] = rng.sample(range(vocab), rng.randint(0, 3))
        kw["ignore_eos"] = rng.random() < 0.3
    if "bad_words" in features:
        words = [[rng.randrange(vocab)]]  # one token: always banned
        if output:
            # The output's own tail plus one token: its last token must be banned.
            n = rng.randint(1, min(3, len(output)))
            words.append(output[-n:] + [rng.randrange(vocab)])
        words.append([rng.randrange(vocab) for _ in range(rng.randint(2, 4))])  # usually no match
        kw["bad_words_token_ids"] = words
    kw["temperature"] = rng.choice([0.0, 1.0])
    return make_request(prompt, output, eos=(rng.randrange(vocab),), **kw)


FEATURES = ["penalties", "logit_bias", "allowed", "bad_words", "min_tokens"]


@pytest.mark.parametrize(
    "features, share",
    [([f], 0.5) for f in FEATURES] + [(FEATURES, 0.5), (["penalties"], 1.0), (FEATURES, 1.0)],
    ids=FEATURES + ["all", "penalties-every-row", "all-every-row"],
)
def test_logits_processors_match_the_reference(features, share):
    rng, vocab = random.Random(" ".join(features) + str(share)), 50
    # A share of the rows use the feature(s), each with random settings; the others use nothing.
    requests = [random_request(rng, vocab, set(features) if rng.random() < share else set()) for _ in range(40)]
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(1))
    md = metadata(requests, vocab)
    ours = apply_logits_processors(logits.clone(), md)
    expected = torch.tensor([reference_processors(row, r) for row, r in zip(logits.tolist(), requests)])
    assert torch.equal(ours.isneginf(), expected.isneginf())
    assert not torch.equal(expected, logits), "the batch changed nothing: the test would prove nothing"
    finite = expected.isfinite()
    torch.testing.assert_close(ours[finite], expected[finite], rtol=1e-5, atol=1e-4)
    # The greedy rows pick the argmax of the processed logits, in the same mixed batch.
    sampled = Sampler()(logits.clone(), md).sampled_token_ids
    for row, request in enumerate(requests):
        if request.sampling_params.greedy:
            assert sampled[row] == expected[row].argmax()
        else:
            assert expected[row, sampled[row]] > -INF


def test_bad_word_prefix_must_be_at_the_end_of_the_output():
    word = [4, 5, 6]
    logits = torch.zeros(3, 10)
    requests = [
        make_request(output=[1, 4, 5], temperature=0, bad_words_token_ids=[word]),  # ends with 4, 5: ban 6
        make_request(output=[4, 5, 1], temperature=0, bad_words_token_ids=[word]),  # 4, 5 not at the end
        make_request(output=[5], temperature=0, bad_words_token_ids=[word]),  # too short
    ]
    out = apply_logits_processors(logits, metadata(requests, 10))
    assert out[:, 6].tolist() == [-INF, 0.0, 0.0]


def test_min_tokens_bans_stop_tokens_only_until_reached():
    logits = torch.zeros(4, 10)
    requests = [
        make_request(output=[1], eos=(2,), min_tokens=2, stop_token_ids=[7], temperature=0),
        make_request(output=[1, 1], eos=(2,), min_tokens=2, stop_token_ids=[7], temperature=0),
        make_request(output=[], eos=(2,), min_tokens=1, stop_token_ids=[7], ignore_eos=True, temperature=0),
        make_request(output=[], eos=(2,), temperature=0),
    ]
    out = apply_logits_processors(logits, metadata(requests, 10))
    assert out[:, 2].tolist() == [-INF, 0.0, 0.0, 0.0]
    assert out[:, 7].tolist() == [-INF, 0.0, -INF, 0.0]


# --- metadata kept across steps -----------------------------------------------------------------


def same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> bool:
    for f in dataclasses.fields(SamplingMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is None or y is None or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif f.name == "generators":
            if x.keys() != y.keys() or any(x[k] is not y[k] for k in x):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize(
    "kwargs, output, expected",
    [
        (dict(temperature=0), [], True),
        (dict(temperature=0, seed=3, top_p=0.5, stop_token_ids=[5]), [4], True),  # greedy ignores these
        (dict(temperature=0.7), [], False),
        (dict(temperature=0, logprobs=0), [], False),
        (dict(temperature=0, repetition_penalty=1.1), [], False),
        (dict(temperature=0, presence_penalty=0.5), [], False),
        (dict(temperature=0, frequency_penalty=-0.5), [], False),
        (dict(temperature=0, bad_words_token_ids=[[4, 5]]), [], False),
        (dict(temperature=0, logit_bias={3: 1.0}), [], False),
        (dict(temperature=0, allowed_token_ids=[1, 2]), [], False),
        (dict(temperature=0, min_tokens=2), [4], False),  # EOS is still banned
        (dict(temperature=0, min_tokens=2), [4, 4], True),
        (dict(temperature=0, structured_outputs=StructuredOutputsParams(regex="a+")), [], False),
    ],
)
def test_argmax_only_means_the_raw_logits_argmax(kwargs, output, expected):
    """A row that takes the sampler service's greedy step: the sampler would take its raw logits' argmax too."""
    request = make_request(output=output, **kwargs)
    assert argmax_only(request) == expected
    if expected:
        md = metadata([request], 16)
        assert md.argmax_only and md.max_num_logprobs is None
        logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        assert Sampler()(logits.clone(), metadata([request] * 4, 16)).sampled_token_ids.tolist() == (
            logits.argmax(dim=-1).tolist()
        )


def test_metadata_cache_reuses_only_what_would_be_built_alike():
    """Step after step, the cached metadata equals a fresh build; it is the same object again exactly while the
    rows are the same requests in the same order and nothing in it follows their outputs."""
    vocab = 20
    seeded = make_request(temperature=0.8, top_k=5, top_p=0.9, seed=3, logprobs=2)
    steady = [make_request(temperature=0), seeded, make_request(temperature=0.5, min_p=0.1, logit_bias={3: 1.0})]
    generators = {1: torch.Generator().manual_seed(3)}
    cache = MetadataCache()
    first = cache.get(steady, generators, vocab, torch.device("cpu"))
    for step in range(3):
        for r in steady:
            r.append_output_token_ids(step)
        md = cache.get(steady, generators, vocab, torch.device("cpu"))
        assert md is first and same_metadata(md, metadata(steady, vocab, generators))
    # Another object, order or vocabulary: built again.
    assert cache.get(steady[::-1], {1: generators[1]}, vocab, torch.device("cpu")) is not first
    assert cache.get([*steady[:2], make_request(temperature=0)], generators, vocab, torch.device("cpu")) is not first
    again = cache.get(steady, generators, vocab, torch.device("cpu"))
    assert cache.get(steady, generators, vocab + 1, torch.device("cpu")) is not again
    # A grammar's mask is the step's own.
    grammar = GrammarBitmask([0], torch.full((1, 1), 0b1000, dtype=torch.int32))
    assert cache.get(steady, generators, vocab, torch.device("cpu"), grammar).grammar_bitmask is not None
    assert cache.get(steady, generators, vocab, torch.device("cpu")).grammar_bitmask is None

    # Settings that follow the output: built every step, and right every step.
    followers = [
        make_request(temperature=0, presence_penalty=0.5, frequency_penalty=0.2),
        make_request(temperature=0, repetition_penalty=1.3),
        make_request(temperature=0, bad_words_token_ids=[[4, 5]]),
        make_request(temperature=0, min_tokens=2, stop_token_ids=[7], eos=(2,)),
    ]
    for request in followers:
        cache = MetadataCache()
        built = []
        for token in (4, 4, 1):
            md = cache.get([steady[0], request], {}, vocab, torch.device("cpu"))
            assert same_metadata(md, metadata([steady[0], request], vocab))
            built.append(md)
            request.append_output_token_ids(token)
        assert len({id(md) for md in built}) == 3, request.sampling_params  # each step's own
    # min_tokens once reached no longer bans anything: from then on the metadata is kept.
    md = cache.get([steady[0], followers[3]], {}, vocab, torch.device("cpu"))
    assert md.banned_rows is None and cache.get([steady[0], followers[3]], {}, vocab, torch.device("cpu")) is md


# --- logprobs -----------------------------------------------------------------------------------


def check_logprobs(lp, logits, token_ids, k):
    reference = torch.log_softmax(logits.double(), dim=-1).float()
    assert lp.token_ids.shape == lp.logprobs.shape == (len(logits), k + 1)
    assert torch.equal(lp.token_ids[:, 0], token_ids)
    torch.testing.assert_close(lp.logprobs[:, 0], reference.gather(1, token_ids.unsqueeze(1)).squeeze(1))
    top_values = reference.sort(dim=-1, descending=True).values[:, :k]
    torch.testing.assert_close(lp.logprobs[:, 1:], top_values)
    # The ids of the top k carry those logprobs (ties may come in any order).
    torch.testing.assert_close(reference.gather(1, lp.token_ids[:, 1:]), top_values)
    for row in range(len(logits)):
        rank = int((reference[row] >= reference[row, token_ids[row]]).sum())
        assert lp.ranks[row] == rank


def test_gather_logprobs():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    logits[2, 3] = logits[2, 4] = logits[2].max() + 1  # a tie at the top
    token_ids = torch.tensor([0, 7, 4, 29, 12])
    logprobs = compute_logprobs(logits.bfloat16())
    assert logprobs.dtype == torch.float32
    for k in (0, 1, 5):
        check_logprobs(gather_logprobs(compute_logprobs(logits), k, token_ids), logits, token_ids, k)
    check_logprobs(gather_logprobs(compute_logprobs(logits), -1, token_ids), logits, token_ids, 30)
    assert gather_logprobs(compute_logprobs(logits), 0, token_ids).ranks[2] == 2  # tied for first


def test_sampler_logprobs_are_of_the_raw_logits():
    vocab = 40
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    requests = [
        make_request(logprobs=3, temperature=0.5, repetition_penalty=2.0, logit_bias={5: 30.0}),
        make_request(temperature=0, presence_penalty=2.0, output=[1, 2]),
        make_request(logprobs=-1, top_k=3, frequency_penalty=1.0, output=[3, 3]),
        make_request(logprobs=0, temperature=0, logit_bias={9: 100.0}),
    ]
    out = run_sampler(logits, requests)
    assert out.sampled_token_ids[0] == 5 and out.sampled_token_ids[3] == 9  # the bias did its work
    check_logprobs(out.logprobs, logits, out.sampled_token_ids, vocab)  # -1: the whole vocabulary


def test_no_logprobs_when_no_row_asks():
    out = run_sampler(torch.randn(3, 20), [make_request(), make_request(temperature=0), make_request(top_k=2)])
    assert out.logprobs is None


# --- greedy -------------------------------------------------------------------------------------


def test_all_greedy_batch_is_the_argmax_and_never_sorts(monkeypatch):
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    md = metadata([make_request(temperature=0, top_k=5, top_p=0.5)] * 8, 100)
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: pytest.fail("an all-greedy batch sorted"))
    monkeypatch.setattr(torch.Tensor, "topk", lambda *a, **k: pytest.fail("an all-greedy batch took a topk"))
    monkeypatch.setattr(torch.Tensor, "softmax", lambda *a, **k: pytest.fail("an all-greedy batch took a softmax"))
    assert torch.equal(Sampler()(logits.clone(), md).sampled_token_ids, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_take_the_argmax():
    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(0))
    greedy_rows = [0, 3, 4, 9]
    requests = [
        make_request(temperature=0, presence_penalty=2.0, output=[int(logits[i].argmax())])
        if i in greedy_rows
        else make_request(temperature=2.0, top_k=3)
        for i in range(10)
    ]
    expected = torch.tensor([reference_processors(row, r) for row, r in zip(logits.tolist(), requests)])
    for _ in range(20):
        sampled = run_sampler(logits, requests).sampled_token_ids
        for row in range(10):
            if row in greedy_rows:
                assert sampled[row] == expected[row].argmax()  # the penalty moved it off the raw argmax
                assert sampled[row] != logits[row].argmax()
            else:
                assert sampled[row] in logits[row].topk(3).indices


def test_empty_batch():
    out = run_sampler(torch.empty(0, 10), [])
    assert out.sampled_token_ids.shape == (0,) and out.logprobs is None


# --- no host synchronisation --------------------------------------------------------------------


def test_sampler_reads_nothing_back_from_the_device():
    """On the meta device every tensor has no data, so any .item(), .tolist(), nonzero or
    boolean-mask indexing in the sampler would raise: each branch must come from the metadata."""
    rng, vocab = random.Random(0), 50
    requests = [random_request(rng, vocab, set(FEATURES)) for _ in range(8)]
    requests += [make_request(top_k=5, top_p=0.8, min_p=0.1, temperature=0.7, logprobs=2), make_request(logprobs=-1)]
    md = metadata(requests, vocab, device="meta")
    out = Sampler()(torch.empty(len(requests), vocab, device="meta"), md)
    assert out.sampled_token_ids.shape == (len(requests),)
    assert out.logprobs.token_ids.shape == (len(requests), vocab + 1)
