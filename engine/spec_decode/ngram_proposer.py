"""N-gram proposer (vLLM's prompt lookup): drafts copied from the request's own tokens, on the host.

The longest suffix of a request's tokens (prompt_lookup_max down to prompt_lookup_min long) that also occurs
earlier in them is looked up, and the tokens that followed its first occurrence are the drafts. Text that
copies from its prompt (code edits, summaries, quotes) gets long runs of right drafts; other text gets few drafts,
and those cost one verified position each.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.sample.rejection_sampler import DraftTokens
from engine.spec_decode.config import SpeculativeConfig


class NgramProposer:
    # It writes no KV and keeps no cache.
    num_lookahead_tokens = 0
    kv_cache_block_bytes = 0

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def run_batch(self, input_ids, positions, metadata) -> None:
        pass

    def propose(self, requests: list, new_token_ids: list[list[int]], so=None) -> dict[str, list[int]]:
        """Drafts to follow each request's tokens and its new ones from this step (none where no suffix recurs)."""
        drafts = {}
        for request, new in zip(requests, new_token_ids):
            drafts[request.request_id] = self.lookup(request.all_token_ids + new)
        return drafts

    def draft_tokens(self, scheduled: list[list[int]], requests: list) -> DraftTokens:
        """The step's drafts for the rejection sampler: n-gram drafts are deterministic, so q is one-hot."""
        return DraftTokens(scheduled)

    def forget(self, request_ids) -> None:
        pass

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Up to k drafts to follow token_ids."""
        k = self.k
        if len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Every window that starts before the suffix itself, compared with the suffix at once.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = hits[0] + n
                return tokens[start : start + k].tolist()
        return []
