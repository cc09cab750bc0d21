"""Sampler: greedy, temperature, top-k/top-p and per-request seeds, batched over rows."""

import torch

from engine.request import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf (k = vocab, p = 1 disable)."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        # The k-th largest logit is the threshold; ties with it stay in.
        kth = logits_sort.gather(1, (logits_sort.size(1) - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - p.unsqueeze(1)
        mask[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(mask, float("-inf"))
    return logits.scatter(1, logits_idx, logits_sort)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab]
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],  # row -> generator, for seeded rows
    ) -> torch.Tensor:
        logits = logits.float()
        greedy = [p.greedy for p in params]
        argmax = logits.argmax(dim=-1)
        if all(greedy):
            return argmax
        device, vocab = logits.device, logits.shape[-1]
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
        logits = logits / temperature.unsqueeze(1)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        k = torch.tensor(top_k, device=device) if any(x < vocab for x in top_k) else None
        p = torch.tensor(top_p, device=device) if any(x < 1.0 for x in top_p) else None
        if k is not None or p is not None:
            logits = apply_top_k_top_p(logits, k, p)
        probs = logits.softmax(dim=-1)
        # Gumbel-max in its exponential form: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_()
        for row, generator in generators.items():
            noise[row].exponential_(generator=generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=device), argmax, sampled)
