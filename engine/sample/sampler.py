"""Sampler: vLLM v1's order over one batch of logits, each row with its own settings.

    float32 -> grammar bitmask -> logprobs -> allowed / bad words -> min_tokens, logit_bias -> penalties
    -> greedy argmax | temperature -> min_p -> top-k, then top-p -> softmax -> one inverse-transform draw a row

A step whose rows are all plain argmaxes (greedy, nothing that changes a logit) skips the float32 copy: the argmax
reads the logits in their own dtype.

Everything that can move the argmax comes before the greedy/random split; greedy rows skip the
rest. The grammar's mask comes first, as vLLM applies it to the logits before its sampler: nothing after it
can pick a token the grammar forbids, and logprobs are those of the masked logits, as vLLM's are. Nothing
here reads a tensor back to the host: the metadata decided every branch already.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.request import RequestFailure
from engine.sample.metadata import GrammarBitmask, MetadataCache, SamplingMetadata
from engine.sample.ops import (
    apply_grammar_bitmask,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    apply_top_p,
    argmax,
    random_sample,
    seeded_generators,
)
from engine.sample.rejection_sampler import DraftTokens, expand_positions, rejection_sample


class SamplerUnavailableError(RuntimeError):
    """The sampler service failed or did not answer in time: the step's requests could not be sampled.
    `lost_request_ids`: the other requests whose seeded generator the service held (their draws could no
    longer match in-process sampling), to fail as well."""

    def __init__(self, message: str, lost_request_ids=()):
        super().__init__(message)
        self.lost_request_ids = list(lost_request_ids)


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [rows, k+1] int64: column 0 the sampled (or given) token, then the top k ids
    logprobs: torch.Tensor  # [rows, k+1] float32
    ranks: torch.Tensor  # [rows] int64: rank of column 0's token in its row


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None  # all rows, None when no row asked for logprobs
    # Rows whose request failed on its own (their token is not to be used); the other rows are as without them.
    failed: dict[int, RequestFailure] = field(default_factory=dict)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax over the vocab."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Each row's token_ids entry and its rank, then the row's num_logprobs best (-1: all)."""
    if num_logprobs == -1:
        num_logprobs = logprobs.size(-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    # vLLM's rank: how many tokens are at least as likely (1 = the most likely).
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    top = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top.indices], dim=1),
        logprobs=torch.cat([token_logprobs, top.values], dim=1),
        ranks=ranks,
    )


def _on_rows(fn, logits: torch.Tensor, rows: torch.Tensor | None, *args) -> torch.Tensor:
    """fn on the given rows only (None: all of them), written back into logits."""
    if rows is None:
        return fn(logits, *args)
    logits[rows] = fn(logits[rows], *args)
    return logits


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Everything that can move the argmax, on float32 logits: bans, bias, penalties (in place where it can)."""
    if md.allowed_mask is not None:
        logits[md.allowed_rows] = logits[md.allowed_rows].masked_fill_(md.allowed_mask, float("-inf"))
    if md.banned_rows is not None:
        logits[md.banned_rows, md.banned_token_ids] = float("-inf")
    if md.bias_rows is not None:
        logits.index_put_((md.bias_rows, md.bias_token_ids), md.bias_values, accumulate=True)
    if md.output_token_counts is not None:
        logits = _on_rows(
            apply_penalties,
            logits,
            md.penalty_rows,
            md.output_token_counts,
            md.seen_token_mask,
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
        )
    return logits


class Sampler:
    def __init__(self, parallel_argmax: bool = True):
        # False in the sampler service: while it samples, the engine builds its next step on the host's other core.
        self.parallel_argmax = parallel_argmax

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: DraftTokens | None = None
    ) -> SamplerOutput:
        """One token per row of logits [num_reqs, vocab]. float32 logits are modified in place.

        With drafts, the rows are each request's verified positions (DraftTokens.positions) and the rejection
        sampler decides its tokens: sampled_token_ids is then [num_reqs, 1 + most drafts], -1 past a row's tokens,
        and logprobs have one row per position."""
        if not metadata.argmax_only:  # logits change before the argmax or the draw: in float32
            logits = logits.to(torch.float32)
        if metadata.grammar_bitmask is not None:
            apply_grammar_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            # Logprobs describe the model's own distribution, before any processing (but the grammar's).
            raw_logprobs = compute_logprobs(logits)
        logits = apply_logits_processors(logits, metadata)
        if drafts is None:
            sampled = position_tokens = self.sample(logits, metadata)
            failed = metadata.failed
        else:
            sampled, position_tokens = rejection_sample(*self.target_probs(logits, metadata), metadata, drafts)
            failed = drafts.request_failures(metadata.failed)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, position_tokens)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, failed=failed)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy, probs = self.target_probs(logits, md)
        if probs is None:
            return greedy
        drawn = random_sample(probs, md.generators)
        if greedy is None:
            return drawn
        return greedy.index_copy_(0, md.random_rows, drawn)

    def target_probs(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The argmax of every row (None when all rows are random), and the distribution each random row draws from
        (md.random_rows' order; None when all rows are greedy)."""
        greedy = None if md.all_random else argmax(logits, self.parallel_argmax)
        if md.all_greedy:
            return greedy, None
        # Only the random rows go on; their settings are indexed by position among them.
        x = logits if md.random_rows is None else logits[md.random_rows]
        if md.temperature is not None:
            x.div_(md.temperature.unsqueeze(1))
        if md.min_p is not None:
            x = _on_rows(apply_min_p, x, md.min_p_rows, md.min_p)
        if md.top_k is not None:
            x = _on_rows(apply_top_k_top_p, x, md.top_k_rows, md.top_k, md.top_k_top_p, md.max_top_k)
        if md.top_p is not None:
            x = _on_rows(apply_top_p, x, md.top_p_rows, md.top_p)
        return greedy, x.softmax(dim=-1)


# A chunk of a prompt's logits to turn into prompt logprobs: (logits, num_logprobs, the prompt tokens they predict).
PromptChunk = tuple[torch.Tensor, int, torch.Tensor]


class BatchSampler:
    """The model runner's sampler, one step at a time: in process (LocalSampler) or on the sampler service
    (mesh.sampler.remote.RemoteSampler). Per-request state that lives across steps (seeded generators, token
    histories) is its own; forget() drops it when requests finish."""

    def sample(
        self,
        requests: list,
        logits: torch.Tensor | None,
        prompt_chunks: list[PromptChunk],
        grammar: GrammarBitmask | None = None,
        drafts: DraftTokens | None = None,
        while_waiting: Callable[[], None] | None = None,
        trace_headers: tuple[tuple[str, str], ...] = (),
    ) -> tuple[SamplerOutput | None, list[LogprobsTensors]]:
        """Row i of logits samples for requests[i], within its grammar's mask if it has one; also each prompt
        chunk's logprobs. None without rows. With drafts, the rows are the requests' verified positions (and
        grammar's rows are positions too), and the rejection sampler decides (Sampler.__call__).

        while_waiting (async scheduling) is called once the step is handed over and before its tokens are
        awaited: while the service samples, or, in process, while the device does (on a CPU: after).
        trace_headers: the engine step's span context (--collect-detailed-traces), for a sampler that makes calls."""
        raise NotImplementedError

    def forget(self, request_ids) -> None:
        pass

    def close(self) -> None:
        pass


class LocalSampler(BatchSampler):
    def __init__(self, device: torch.device):
        self.device = device
        self.sampler = Sampler()
        # Seeded requests' generators, set again for each draw (ops.seeded_generators).
        self.generators: dict[str, list[torch.Generator]] = {}
        self.metadata = MetadataCache()

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def sample(self, requests, logits, prompt_chunks, grammar=None, drafts=None, while_waiting=None, trace_headers=()):
        prompt_logprobs = [gather_logprobs(compute_logprobs(lg), k, targets) for lg, k, targets in prompt_chunks]
        output = None if logits is None else self._sample_rows(requests, logits, grammar, drafts)
        if while_waiting is not None:
            while_waiting()
        return output, prompt_logprobs

    def _sample_rows(self, requests, logits, grammar, drafts) -> SamplerOutput:
        rows = requests if drafts is None else expand_positions(requests, drafts)
        generators = seeded_generators(rows, self.generators, self.device)
        metadata = self.metadata.get(rows, generators, logits.shape[-1], self.device, grammar)
        return self.sampler(logits, metadata, drafts)
