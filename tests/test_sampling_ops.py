"""The sampler's C++ kernel (kernels/cpu/sampling.cpp) against torch, the greedy path that uses it, top-p's partial
search against a sort of the whole vocabulary, and the random draw's inverse transform."""

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sample.metadata import SamplingMetadata
from engine.sample.ops import apply_top_p, argmax, inverse_transform, random_sample
from engine.sample.sampler import Sampler
from kernels.cpu_ops import load

load()  # registers torch.ops.llmmesh_sampling
argmax_rows = torch.ops.llmmesh_sampling.argmax_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def awkward_logits(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, and rows whose maximum is tied, NaN, -inf or at either end of the row."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    logits[0, vocab // 3] = logits[0, vocab - 2] = 50  # a tie: the first one wins
    logits[1] = float("-inf")  # all -inf: index 0
    logits[2] = 0  # all equal: index 0
    logits[3, vocab // 2] = float("nan")  # a NaN wins over any number, the first NaN over later ones
    logits[3, vocab - 1] = float("nan")
    logits[4, vocab - 1] = 60  # the last element
    logits[5, 0] = float("inf")  # +inf beats every number
    logits[6, vocab // 4] = logits[6, vocab // 2] = float("inf")
    return logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 7, 33, 1024, 1025, 49152], ids=lambda v: f"vocab{v}")
def test_argmax_kernel_matches_torch(dtype, vocab):
    logits = awkward_logits(40, max(vocab, 7), dtype)[:, :vocab]  # vocab 1 keeps a view: rows strided
    expected = logits.argmax(dim=-1)
    assert torch.equal(argmax_rows(logits), expected)
    assert torch.equal(argmax_rows(logits, False), expected)  # on this thread alone
    assert torch.equal(argmax(logits), expected)
    assert torch.equal(argmax_rows(logits[:0]), torch.empty(0, dtype=torch.int64))


def test_argmax_kernel_reads_a_row_strided_block_in_place():
    logits = awkward_logits(16, 3000, torch.bfloat16)
    window = logits[2:14, 500:2700]  # rows contiguous, strided between them
    assert torch.equal(argmax_rows(window), window.argmax(dim=-1))


def test_greedy_step_takes_the_argmax_in_the_logits_dtype(monkeypatch):
    """A step of plain greedy rows makes no float32 copy, whatever the dtype; a penalty brings it back."""
    logits = awkward_logits(8, 500, torch.bfloat16)[[0, 2, 4, 5, 6, 7]]
    plain = [Request(f"r{i}", [1, 2], SamplingParams(temperature=0), eos_token_ids=(0,)) for i in range(6)]
    md = SamplingMetadata.from_requests(plain, {}, 500, torch.device("cpu"))
    assert md.argmax_only
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("a plain greedy step copied its logits"))
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.float().argmax(dim=-1))
    monkeypatch.setattr(torch.Tensor, "to", to)
    penalized = plain[:5] + [Request("p", [1, 2], SamplingParams(temperature=0, presence_penalty=0.5), (0,))]
    assert not SamplingMetadata.from_requests(penalized, {}, 500, torch.device("cpu")).argmax_only


def sorted_nucleus(logits: torch.Tensor, p: float) -> tuple[set[int], set[int]]:
    """A row's top-p nucleus by a float64 sort of the whole row, and the tokens too near its edge to tell."""
    probs = logits.double().softmax(dim=-1)
    top, ids = probs.sort(descending=True)
    more_likely = top.cumsum(dim=-1) - top
    near = (more_likely - p).abs() < 1e-5
    return set(ids[more_likely < p].tolist()), set(ids[near].tolist())


def test_top_p_keeps_the_nucleus_a_sort_finds():
    """Rows peaked to flat, so that the nucleus is found among the first candidates, among 16x as many, or only
    by sorting the whole row; each row keeps what a sort keeps and the rest is -inf."""
    generator = torch.Generator().manual_seed(0)
    vocab, scales = 49152, [12.0, 6.0, 3.0, 2.0, 1.0, 0.3, 0.05]
    logits = torch.cat([torch.randn(4, vocab, generator=generator) * s for s in scales])
    p = torch.tensor([0.5, 0.9, 0.95, 0.99] * len(scales))
    sizes = []
    for batch in (slice(None), slice(-8, None)):  # mixed paths; only rows that sort
        kept = apply_top_p(logits[batch].clone(), p[batch], first_k=64).isfinite()
        for row, row_logits in enumerate(logits[batch]):
            nucleus, near = sorted_nucleus(row_logits, p[batch][row].item())
            got = set(kept[row].nonzero().squeeze(1).tolist())
            assert got - near == nucleus - near, f"row {row}"
            sizes.append(len(nucleus))
    # The rows cover every path: within 64 candidates, within 64 x 16, and past a quarter of the vocabulary.
    assert min(sizes) <= 64 and any(64 < n <= 1024 for n in sizes) and min(sizes[-8:]) > vocab // 4


WEIGHTS = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0], [5.0, 0.0, 0.0, 0.0, 0.0]])


def test_the_inverse_transform_takes_only_tokens_of_weight_above_zero_at_either_end_of_u():
    """u = 0 takes the first token of weight > 0; the largest u below 1 the last one, also where zeros follow it. A
    row of no weight, or NaN, still takes a token of the vocabulary."""
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    for u, expected in ((0.0, [1, 4, 0]), (below_one.item(), [3, 4, 0])):
        assert inverse_transform(WEIGHTS, torch.full((3, 1), u, dtype=torch.float64)).tolist() == expected
    nothing = torch.tensor([[0.0, 0.0, 0.0], [float("nan")] * 3])
    assert inverse_transform(nothing, torch.full((2, 1), 0.5, dtype=torch.float64)).tolist() == [2, 2]


def test_random_draws_follow_the_weights_and_seeded_rows_repeat():
    """Weights that do not sum to 1, zeros among them: 20,000 draws a row only ever take tokens of weight > 0, in
    their proportion (within five standard deviations); a seeded row draws the same token for the same seed."""
    n = 20_000
    draws = random_sample(WEIGHTS.repeat(n, 1), {}).view(n, 3)
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {4} and set(draws[:, 2].tolist()) == {0}
    ones = (draws[:, 0] == 1).sum().item()  # p = 2/3
    assert abs(ones - n * 2 / 3) < 5 * (n * 2 / 3 * 1 / 3) ** 0.5, ones
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)), dim=-1)
    seeded = [random_sample(probs.clone(), {1: torch.Generator().manual_seed(7)})[1].item() for _ in range(3)]
    assert len(set(seeded)) == 1
