"""The sampler's tensor operations, each on a [rows, vocab] float32 block (in place where it can)."""

import functools

import torch


@functools.cache
def _cpu_argmax():
    """The C++ argmax (kernels/cpu/sampling.cpp), or None where the CPU kernels cannot be built."""
    from kernels.cpu_ops import try_load

    return torch.ops.llmmesh_sampling.argmax_rows if try_load() is not None else None


def argmax(logits: torch.Tensor, parallel: bool = True) -> torch.Tensor:
    """Each row's argmax (torch.argmax's: the first of equal maxima), read in the logits' own dtype. On a CPU the
    C++ kernel (torch's argmax there takes about ten times as long), on torch's threads or, parallel=False, on the
    calling thread alone."""
    if logits.device.type == "cpu" and logits.size(-1) and (kernel := _cpu_argmax()) is not None:
        return kernel(logits.contiguous(), parallel)
    return logits.argmax(dim=-1)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """Tokens the grammar does not allow get -inf, on the given rows (None: all), in place (xgrammar's kernel)."""
    import xgrammar  # here: only a step with structured requests needs it (it takes seconds to import)

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def apply_penalties(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,  # [rows, vocab] float32
    seen_token_mask: torch.Tensor | None,  # [rows, vocab] bool: in prompt or output; None: no repetition penalty
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's (and OpenAI's / CTRL's) repetition, frequency and presence penalties."""
    if seen_token_mask is not None:
        # Repetition pushes a seen token towards "less likely" whatever its sign.
        rep = repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen_token_mask, penalized, logits)
    logits -= frequency_penalties.unsqueeze(1) * output_token_counts
    logits -= presence_penalties.unsqueeze(1) * (output_token_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor,  # [rows] int64, each in [1, max_k]
    p: torch.Tensor | None,  # [rows] float32, 1 = off; None: no row has a top-p
    max_k: int,
) -> torch.Tensor:
    """Keep each row's k most likely tokens, then the top-p nucleus of those; the rest get -inf.

    Only the top max_k tokens can survive, so a partial topk replaces a sort of the whole vocabulary.
    Tokens tied with the k-th may stay.
    """
    top_values, top_ids = logits.topk(max_k, dim=-1)  # most likely first
    kth = top_values.gather(1, (k - 1).unsqueeze(1))
    top_values.masked_fill_(top_values < kth, float("-inf"))
    if p is not None:
        # Top-p over the top-k, renormalised: keep a token while the more likely ones hold less than p.
        probs = top_values.softmax(dim=-1)
        more_likely_mass = probs.cumsum(dim=-1) - probs  # 0 for the first token: it always stays
        top_values.masked_fill_(more_likely_mass >= p.unsqueeze(1), float("-inf"))
    return logits.fill_(float("-inf")).scatter_(1, top_ids, top_values)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor, first_k: int = 256) -> torch.Tensor:
    """Keep each row's top-p nucleus: the most likely tokens until their mass reaches p.

    A nucleus is rarely more than a few hundred tokens, so each row looks for it among its first_k most likely
    (a partial topk, many times cheaper than sorting a 49,152-token vocabulary). A row whose candidates hold less
    than p looks again among 16x as many where those could hold p (each is at most as likely as its last
    candidate); where they could not, or once 16x is a quarter of the vocabulary, it sorts the whole row. Tokens
    tied with the last one kept may go either way, as with a sort."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    rows, k, vocab, to_sort = torch.arange(len(probs)), first_k, probs.size(-1), []
    while len(rows) and 4 * k < vocab:
        top, ids = probs[rows].topk(k, dim=-1)  # most likely first
        mass = top.cumsum(dim=-1)
        row_p = p[rows]
        done = mass[:, -1] >= row_p
        # Keep a token while the more likely ones hold less than p: the most likely always stays.
        keep[rows[done]] = keep[rows[done]].scatter_(1, ids[done], (mass - top)[done] < row_p[done, None])
        reachable = mass[:, -1] + 15 * k * top[:, -1] >= row_p
        to_sort.append(rows[~done & ~reachable])
        rows, k = rows[~done & reachable], 16 * k
    to_sort = torch.cat([*to_sort, rows])
    if len(to_sort) == len(logits):
        return sorted_top_p(logits, p)
    keep[to_sort] = True
    logits.masked_fill_(~keep, float("-inf"))
    if len(to_sort):
        logits[to_sort] = sorted_top_p(logits[to_sort], p[to_sort])
    return logits


def sorted_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """apply_top_p by a sort of the whole vocabulary."""
    logits_sort, logits_idx = logits.sort(dim=-1)  # ascending: the most likely token is last
    # Drop the least likely tokens while their total mass stays within 1 - p.
    cum_probs = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
    drop = cum_probs <= 1 - p.unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, logits_idx, logits_sort)


MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's draw for its output token `index` (splitmix64 of the pair).

    Each draw depends on the request's seed and the token's place alone, not on how many draws came before on
    this engine: a request resumed on another engine with its output so far draws its next token exactly as it
    would have where it started. Child i of a seeded request has seed + i; the mixing keeps its draws unrelated
    to child 0's later ones."""
    x = (seed * 0x9E3779B97F4A7C15 + index) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seeded_generators(rows, kept: dict, device: torch.device) -> dict[int, torch.Generator]:
    """Row -> its generator, for the seeded random rows, each set for that row's token (draw_seed with the
    row's output so far: a draft position's row counts the drafts before it). kept: request id -> its
    generators, one per row it has in a step, kept from step to step (a metadata kept for a steady batch holds
    the same objects)."""
    generators, taken = {}, {}
    for row, request in enumerate(rows):
        params = request.sampling_params
        if params.seed is None or params.greedy:
            continue
        k = taken[request.request_id] = taken.get(request.request_id, -1) + 1
        own = kept.setdefault(request.request_id, [])
        if len(own) <= k:
            own.append(torch.Generator(device))
        generators[row] = own[k].manual_seed(draw_seed(params.seed, len(request.output_token_ids)))
    return generators


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from probs (weights >= 0, not necessarily summing to 1), without torch.multinomial (it
    makes the host wait).

    Inverse transform: one U ~ Uniform[0, 1) a row, and the first token whose running total of the row's weights
    (float64, summed in order) exceeds U times the row's total. A row takes one random number, not one per token
    of the vocabulary as a Gumbel-max draw does (on a CPU those are most of a sampled step's sampling). A token of
    weight 0 adds nothing to the total, so it is never drawn. Seeded rows take their U from their own generator, so
    their draws do not depend on what else is in the batch."""
    u = torch.empty(probs.size(0), 1, dtype=torch.float64, device=probs.device)
    if len(generators) < probs.size(0):
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    return inverse_transform(probs, u)


def inverse_transform(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token each row of weights [rows, vocab] draws for its u [rows, 1] (float64, in [0, 1)): the first whose
    running total exceeds u times the row's total."""
    totals = weights.to(torch.float64).cumsum_(dim=-1)
    # u < 1 keeps u * total below a total > 0 (float64: a float32 total is never subnormal there), so some token of
    # weight > 0 exceeds it. A row with no weight (or NaN) finds none: it takes the last token rather than one past it.
    drawn = torch.searchsorted(totals, u * totals[:, -1:], right=True).squeeze(1)
    return drawn.clamp_(max=weights.size(-1) - 1)
