"""The rejection sampler of speculative decoding: which drafts a step keeps, and the target model's next token.

Each request with k drafts has k + 1 verified positions in the step's logits: position j holds the target model's
distribution p_j given the request's tokens and drafts 0..j-1. As the reference's rejection sampling:
- a greedy request keeps its drafts while each is the target's argmax, then the argmax at the first mismatch (or
  after the last draft: the bonus token); its output is exactly the target's greedy output;
- a random request accepts draft d_j with probability min(1, p_j(d_j) / q_j(d_j)), q_j being the draft model's
  distribution (one-hot for a draft proposed deterministically, as n-gram drafts are); at the first rejection it
  draws from the normalised residual max(0, p_j - q_j), and when all are accepted, from p_k. Its tokens follow the
  target distribution exactly.
p_j is the distribution plain sampling would draw from (penalties, temperature, top-k/top-p... applied with the
drafts before j as output). Everything stays on the device: the accepted lengths are a cumulative product.
"""

from dataclasses import dataclass

import torch

from engine.request import RequestFailure
from engine.sample.ops import random_sample

PLACEHOLDER_TOKEN_ID = -1  # past a request's tokens in the sampled block


@dataclass
class DraftTokens:
    """A step's drafts to verify, per request row (in the rows' order; [] for a request without drafts)."""

    token_ids: list[list[int]]
    # [total drafts, vocab] float32: the draft model's q for each draft, in order; None: q is one-hot on the draft.
    probs: torch.Tensor | None = None

    @property
    def num_positions(self) -> list[int]:
        """Verified positions (rows of logits) of each request: its drafts and the one after them."""
        return [len(d) + 1 for d in self.token_ids]

    def request_failures(self, position_failures: dict[int, RequestFailure]) -> dict[int, RequestFailure]:
        """Failures by position row -> by request row (a request fails if any of its positions did)."""
        failed, start = {}, 0
        for i, n in enumerate(self.num_positions):
            for row in range(start, start + n):
                if row in position_failures:
                    failed.setdefault(i, position_failures[row])
            start += n
        return failed


class PositionView:
    """A request as sampling sees it at one verified position: the drafts before that position are its latest
    output tokens (what penalties, min_tokens and bad words look at)."""

    __slots__ = ("request_id", "sampling_params", "prompt_token_ids", "output_token_ids", "eos_token_ids")

    def __init__(self, request, drafts_before: list[int]):
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + drafts_before if drafts_before else request.output_token_ids
        self.eos_token_ids = request.eos_token_ids


def pad_token_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Each request's tokens as one row of the sampled block, -1 after them."""
    out = torch.full((len(rows), width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def expand_positions(requests: list, drafts: DraftTokens) -> list[PositionView]:
    """One row per verified position of each request, in order."""
    return [PositionView(r, d[:j]) for r, d in zip(requests, drafts.token_ids) for j in range(len(d) + 1)]


def rejection_sample(
    greedy: torch.Tensor | None, probs: torch.Tensor | None, md, drafts: DraftTokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy: every position's argmax (None when all are random); probs: p of the random positions (md.random_rows'
    order; None when all are greedy); md: the positions' SamplingMetadata.

    Returns the tokens, [num_reqs, 1 + most drafts] (accepted drafts, then the target's token, then -1), and each
    position's token ([num_positions]: the output token at that position, 0 past the request's tokens) for its
    logprobs."""
    device = (greedy if greedy is not None else probs).device
    counts = drafts.num_positions
    num_reqs, width = len(counts), max(counts)
    req_of_row = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(counts))
    pos_of_row = torch.cat([torch.arange(n) for n in counts])
    draft_matrix = torch.full((num_reqs, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    for i, d in enumerate(drafts.token_ids):
        draft_matrix[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
    host_drafts = draft_matrix[req_of_row, pos_of_row]  # -1 at each bonus position
    row_drafts = host_drafts.to(device, non_blocking=True)
    draft_matrix = draft_matrix.to(device, non_blocking=True)
    req_of_row, pos_of_row = req_of_row.to(device, non_blocking=True), pos_of_row.to(device, non_blocking=True)

    if greedy is not None:
        target, accepted = greedy, greedy == row_drafts
    else:
        target = torch.empty(len(row_drafts), dtype=torch.int64, device=device)
        accepted = torch.empty(len(row_drafts), dtype=torch.bool, device=device)
    if probs is not None:
        rows = md.random_rows
        d = row_drafts if rows is None else row_drafts[rows]
        drafted = d >= 0
        d = d.clamp(min=0).unsqueeze(1)
        if drafts.probs is None:  # q one-hot: accept with p(d); the residual is p without d
            q = torch.zeros_like(probs).scatter_(1, d, drafted.unsqueeze(1).to(probs.dtype))
        else:
            q = torch.zeros_like(probs)
            draft_rows = (row_drafts >= 0).nonzero().squeeze(1)
            where = torch.full((len(row_drafts),), -1, dtype=torch.int64, device=device)
            where[draft_rows] = torch.arange(len(draft_rows), device=device)
            sel = where if rows is None else where[rows]
            q[drafted] = drafts.probs.to(device, torch.float32)[sel[drafted]]
        p_d, q_d = probs.gather(1, d).squeeze(1), q.gather(1, d).squeeze(1)
        u = torch.empty_like(p_d)
        if len(md.generators) < len(u):
            u.uniform_()
        # Seeded positions with a draft take their uniform from their own generator (before its draw below); a
        # request without drafts then draws exactly as without speculation.
        random_row_ids = range(len(row_drafts)) if rows is None else md.random_row_ids
        has_draft = host_drafts >= 0
        for row, generator in md.generators.items():
            if has_draft[random_row_ids[row]]:
                u[row].uniform_(generator=generator)
        random_accepted = drafted & (u * q_d < p_d)
        residual = (probs - q).clamp_(min=0)
        # Where p <= q everywhere the draft is always accepted and the residual is never used: keep it drawable.
        empty = residual.sum(dim=-1, keepdim=True) == 0
        dist = torch.where(drafted.unsqueeze(1) & ~empty, residual, probs)
        drawn = random_sample(dist, md.generators)
        if rows is None:
            target, accepted = drawn, random_accepted
        else:
            target = target.index_copy(0, rows, drawn)
            accepted = accepted.index_copy(0, rows, random_accepted)

    accepted_matrix = torch.zeros((num_reqs, width), dtype=torch.int64, device=device)
    accepted_matrix[req_of_row, pos_of_row] = accepted.to(torch.int64)
    target_matrix = torch.zeros((num_reqs, width), dtype=torch.int64, device=device)
    target_matrix[req_of_row, pos_of_row] = target
    num_accepted = accepted_matrix.cumprod(dim=1).sum(dim=1, keepdim=True)  # leading accepted drafts
    columns = torch.arange(width, device=device).unsqueeze(0)
    placeholder = torch.full_like(draft_matrix, PLACEHOLDER_TOKEN_ID)
    sampled = torch.where(
        columns < num_accepted, draft_matrix, torch.where(columns == num_accepted, target_matrix, placeholder)
    )
    return sampled, sampled[req_of_row, pos_of_row].clamp(min=0)
