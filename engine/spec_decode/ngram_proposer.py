"""N-gram proposer (vLLM's prompt lookup): drafts copied from the request's own tokens, on the host.

The longest suffix of a request's tokens (prompt_lookup_max down to prompt_lookup_min long) that also occurs
earlier in them is looked up, and the tokens that followed its first occurrence are the drafts. Text that
copies from its prompt (code edits, summaries, quotes) gets long runs of right drafts; other text gets few drafts,
and those cost one verified position each.
"""

import numpy as np

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
        if len(token_ids) <= self.min_n:
            return []
        # As bytes, four a token, so that each suffix is found by one bytes.find (memmem) over the history.
        tokens = np.asarray(token_ids, dtype=np.int32)
        history = tokens[:-1].tobytes()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:].tobytes()
            at = history.find(suffix)
            while at % 4 and at != -1:  # a match must start on a token
                at = history.find(suffix, at + 1)
            if at != -1:
                start = at // 4 + n
                return tokens[start : start + self.k].tolist()
        return []
