"""The sampler's C++ kernel (kernels/cpu/sampling.cpp) against torch, and the greedy path that uses it."""

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sample.metadata import SamplingMetadata
from engine.sample.ops import argmax
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
