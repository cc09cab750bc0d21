"""SamplingMetadata: one step's sampling settings as device tensors, built once on the host.

Every decision that depends on the settings (which rows need penalties, a sort, a seed...) is
made here from Python values, so the sampler itself never has to read a tensor back to the host.
Row subsets are int64 index tensors. A feature no row uses has None for all its tensors; a subset
that is every row is None too, so the sampler works on the whole block without gathering.

Each request's own settings (its bans, bias, allowed ids) are worked out and checked on their own first: if that
raises for one request, its row is sampled as a plain greedy row, its token is thrown away and `failed` says why,
and the rest of the batch is sampled exactly as it would have been without it.
"""

import operator
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch

from engine.request import RequestFailure, SamplingParams

if TYPE_CHECKING:
    from engine.request import Request

# What a failed row samples with: greedy, nothing else (its token is dropped).
_FAILED_ROW = SamplingParams(temperature=0.0)


@dataclass
class GrammarBitmask:
    """The step's grammar masks (structured output): bitmask[j] is for row rows[j] of the step's logits."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the host; xgrammar's packed bits, set = allowed


@dataclass
class SamplingMetadata:
    num_reqs: int
    vocab_size: int

    # Greedy rows take the argmax, random rows draw.
    all_greedy: bool
    all_random: bool
    random_rows: torch.Tensor | None = None  # rows that draw; None when all_random or all_greedy
    random_row_ids: list[int] = field(default_factory=list)  # the rows that draw, on the host

    # Settings of the random rows. Rows here are positions among the random rows, not batch rows.
    temperature: torch.Tensor | None = None  # [r] float32; None when every random row has temperature 1
    min_p_rows: torch.Tensor | None = None  # random rows with min_p > 0
    min_p: torch.Tensor | None = None  # [len(min_p_rows)] float32
    # Rows with a top-k (and maybe a top-p): a topk(max_top_k) stands in for sorting the vocabulary.
    top_k_rows: torch.Tensor | None = None  # random rows with 0 < top_k < vocab
    top_k: torch.Tensor | None = None  # [len(top_k_rows)] int64
    top_k_top_p: torch.Tensor | None = None  # [len(top_k_rows)] float32, those rows' top_p (1 = off); None if all 1
    max_top_k: int = 0
    # Rows with a top-p and no top-k: these need the sort.
    top_p_rows: torch.Tensor | None = None
    top_p: torch.Tensor | None = None  # [len(top_p_rows)] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # random row -> its generator

    # Logits processors, on batch rows.
    allowed_rows: torch.Tensor | None = None  # rows with allowed_token_ids
    allowed_mask: torch.Tensor | None = None  # [len(allowed_rows), vocab] bool, True = not allowed
    banned_rows: torch.Tensor | None = None  # (row, token) pairs that get -inf: bad words and min_tokens
    banned_token_ids: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None  # (row, token, bias) triples of logit_bias
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None  # float32

    # Penalties, only on the rows that have one.
    penalty_rows: torch.Tensor | None = None  # [m]; None when every row has one
    presence_penalties: torch.Tensor | None = None  # [m] float32
    frequency_penalties: torch.Tensor | None = None  # [m] float32
    repetition_penalties: torch.Tensor | None = None  # [m] float32
    output_token_counts: torch.Tensor | None = None  # [m, vocab] float32: count of each token in the output
    seen_token_mask: torch.Tensor | None = None  # [m, vocab] bool: in prompt or output; None: no repetition penalty

    # Structured output: [num_reqs, ceil(vocab / 32)] int32 (all bits set on rows without a grammar), and the rows
    # that have one (None: every row).
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | None = None

    # The largest logprobs asked for in the batch (-1 made vocab_size); None when no row asks.
    max_num_logprobs: int | None = None
    # Rows whose own settings could not be worked out: sampled greedily, their token not to be used.
    failed: dict[int, RequestFailure] = field(default_factory=dict)

    @property
    def argmax_only(self) -> bool:
        """Every row is greedy and nothing changes a logit first: each row's token is the argmax of its raw logits."""
        return (
            self.all_greedy
            and self.grammar_bitmask is None
            and self.allowed_rows is None
            and self.banned_rows is None
            and self.bias_rows is None
            and self.output_token_counts is None
        )

    @classmethod
    def from_requests(
        cls,
        requests: list["Request"],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
        grammar: GrammarBitmask | None = None,
    ) -> "SamplingMetadata":
        """Row i is requests[i]. generators maps row -> that row's torch.Generator (only seeded, non-greedy rows);
        grammar: the grammar masks of the rows that have one."""
        rows: list[_Row | None] = []
        failed = {}
        for i, request in enumerate(requests):
            try:
                rows.append(_Row.of(request, vocab_size))
            except Exception as e:  # noqa: BLE001 (this request's settings alone: its batch mates go on)
                rows.append(None)
                failed[i] = RequestFailure.from_exception(request.request_id, "sampling", e)
        params = [_FAILED_ROW if row is None else row.params for row in rows]
        random = [i for i, p in enumerate(params) if not p.greedy]
        asked = [vocab_size if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None]
        md = cls(
            num_reqs=len(requests),
            vocab_size=vocab_size,
            all_greedy=not random,
            all_random=bool(random) and len(random) == len(requests),
            max_num_logprobs=max(asked) if asked else None,
            failed=failed,
            random_row_ids=random,
        )
        if random and not md.all_random:
            md.random_rows = _tensor(random, torch.int64, device)
        if random:
            _set_random_row_settings(md, [params[i] for i in random], device)
            position = {row: j for j, row in enumerate(random)}
            md.generators = {position[row]: g for row, g in generators.items() if row in position}
        _set_bans_and_bias(md, rows, vocab_size, device)
        _set_penalties(md, rows, vocab_size, device)
        if grammar is not None and grammar.rows:
            bitmask = torch.full((len(requests), grammar.bitmask.shape[1]), -1, dtype=torch.int32)
            bitmask[grammar.rows] = grammar.bitmask
            md.grammar_bitmask = bitmask.to(device, non_blocking=True)
            md.grammar_rows = None if len(grammar.rows) == len(requests) else list(grammar.rows)
        return md


class MetadataCache:
    """A batch's SamplingMetadata kept from one step to the next. While the rows are the same requests (the same
    objects, in the same order) and nothing in it follows their outputs (penalties, bad words, min_tokens still to
    reach, a grammar's mask), the last step's metadata is this step's too: a steady decode batch does not build it
    again every step."""

    def __init__(self):
        self._rows: list = []
        self._metadata: SamplingMetadata | None = None

    def get(
        self,
        requests: list["Request"],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
        grammar: GrammarBitmask | None = None,
    ) -> SamplingMetadata:
        """SamplingMetadata.from_requests(...), or the same metadata again when it would be built alike (a
        seeded row's generator is the same object from step to step)."""
        md = self._metadata
        if (
            md is not None
            and grammar is None
            and md.vocab_size == vocab_size
            and len(requests) == len(self._rows)
            and all(map(operator.is_, requests, self._rows))
        ):
            return md
        md = SamplingMetadata.from_requests(requests, generators, vocab_size, device, grammar)
        steady = grammar is None and not md.failed and md.output_token_counts is None and all(map(_steady, requests))
        self._rows, self._metadata = (list(requests), md) if steady else ([], None)
        return md


def argmax_only(request: "Request") -> bool:
    """Its token this step is the argmax of its raw logits: greedy and plain_sampling. Once true, true for the rest
    of the request."""
    return request.sampling_params.greedy and plain_sampling(request)


def plain_sampling(request: "Request") -> bool:
    """Its token this step depends on its raw logits and its temperature, min-p, top-k and top-p alone: it asks for
    no logprobs, and nothing (penalties, bans, bias, allowed ids, a grammar) changes a logit first. Once true, true
    for the rest of the request."""
    p = request.sampling_params
    return (
        p.logprobs is None
        and not _has_penalty(p)
        and not p.bad_words_token_ids
        and not p.logit_bias
        and p.allowed_token_ids is None
        and p.structured_outputs is None
        and len(request.output_token_ids) >= p.min_tokens
    )


def _steady(request: "Request") -> bool:
    """Its row's settings no longer change with its output (penalties are seen in the metadata itself)."""
    p = request.sampling_params
    return not p.bad_words_token_ids and len(request.output_token_ids) >= p.min_tokens


@dataclass
class _Row:
    """One request's sampling settings as host values, checked against the vocabulary."""

    params: SamplingParams
    banned: list[int]  # tokens that get -inf this step: bad words' last tokens, stop tokens before min_tokens
    bias: list[tuple[int, float]]
    allowed: list[int] | None
    output_token_ids: list[int]
    prompt_token_ids: list[int]

    @classmethod
    def of(cls, request: "Request", vocab_size: int) -> "_Row":
        p = request.sampling_params
        row = cls(
            p,
            sorted(_banned_bad_words(request) | _banned_before_min_tokens(request)),
            list((p.logit_bias or {}).items()),
            p.allowed_token_ids,
            request.output_token_ids,
            request.prompt_token_ids,
        )
        for name, ids in (
            ("bad_words/stop_token_ids", row.banned),
            ("logit_bias", p.logit_bias or ()),
            ("allowed_token_ids", row.allowed or ()),
        ):
            # min and max run in C: this runs every step, over up to --max-allowed-token-ids ids.
            if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {bad[:3]}")
        return row


def _tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Built on the host, then an async copy: nothing waits for work already queued on the device.
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _subset(rows: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    return None if len(rows) == total else _tensor(rows, torch.int64, device)


def _set_random_row_settings(md: SamplingMetadata, random: list[SamplingParams], device: torch.device) -> None:
    n = len(random)
    if any(p.temperature != 1.0 for p in random):
        md.temperature = _tensor([p.temperature for p in random], torch.float32, device)
    min_p = [j for j, p in enumerate(random) if p.min_p > 0]
    if min_p:
        md.min_p_rows = _subset(min_p, n, device)
        md.min_p = _tensor([random[j].min_p for j in min_p], torch.float32, device)
    top_k = [j for j, p in enumerate(random) if 0 < p.top_k < md.vocab_size]
    if top_k:
        md.top_k_rows = _subset(top_k, n, device)
        md.top_k = _tensor([random[j].top_k for j in top_k], torch.int64, device)
        md.max_top_k = max(random[j].top_k for j in top_k)
        if any(random[j].top_p < 1.0 for j in top_k):
            md.top_k_top_p = _tensor([random[j].top_p for j in top_k], torch.float32, device)
    top_p = [j for j, p in enumerate(random) if p.top_p < 1.0 and not 0 < p.top_k < md.vocab_size]
    if top_p:
        md.top_p_rows = _subset(top_p, n, device)
        md.top_p = _tensor([random[j].top_p for j in top_p], torch.float32, device)


def _set_bans_and_bias(md: SamplingMetadata, rows: list[_Row | None], vocab_size: int, device: torch.device) -> None:
    allowed = [i for i, row in enumerate(rows) if row is not None and row.allowed is not None]
    if allowed:
        mask = torch.ones(len(allowed), vocab_size, dtype=torch.bool)
        for j, i in enumerate(allowed):
            mask[j, rows[i].allowed] = False
        md.allowed_rows = _tensor(allowed, torch.int64, device)
        md.allowed_mask = mask.to(device, non_blocking=True)

    banned_rows, banned_tokens = [], []
    for i, row in enumerate(rows):
        if row is not None:
            banned_rows += [i] * len(row.banned)
            banned_tokens += row.banned
    if banned_rows:
        md.banned_rows = _tensor(banned_rows, torch.int64, device)
        md.banned_token_ids = _tensor(banned_tokens, torch.int64, device)

    bias = [(i, token, value) for i, row in enumerate(rows) if row is not None for token, value in row.bias]
    if bias:
        rows_, tokens, values = zip(*bias)
        md.bias_rows = _tensor(rows_, torch.int64, device)
        md.bias_token_ids = _tensor(tokens, torch.int64, device)
        md.bias_values = _tensor(values, torch.float32, device)


def _banned_bad_words(request: "Request") -> set[int]:
    """A bad word's last token is banned when the output so far ends with the rest of the word."""
    output = request.output_token_ids
    banned = set()
    for word in request.sampling_params.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            banned.add(word[-1])
    return banned


def _banned_before_min_tokens(request: "Request") -> set[int]:
    """Until min_tokens are out, no stop token may be sampled (EOS too, unless ignore_eos)."""
    p = request.sampling_params
    if len(request.output_token_ids) >= p.min_tokens:
        return set()
    stop = set(p.stop_token_ids)
    if not p.ignore_eos:
        stop.update(request.eos_token_ids)
    return stop


def _set_penalties(md: SamplingMetadata, rows: list[_Row | None], vocab_size: int, device: torch.device) -> None:
    penalized = [i for i, row in enumerate(rows) if row is not None and _has_penalty(row.params)]
    if not penalized:
        return
    params = [rows[i].params for i in penalized]
    md.penalty_rows = _subset(penalized, len(rows), device)
    md.presence_penalties = _tensor([p.presence_penalty for p in params], torch.float32, device)
    md.frequency_penalties = _tensor([p.frequency_penalty for p in params], torch.float32, device)
    md.repetition_penalties = _tensor([p.repetition_penalty for p in params], torch.float32, device)
    md.output_token_counts = _token_counts([rows[i].output_token_ids for i in penalized], vocab_size, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in penalized]
        md.seen_token_mask = _token_mask(seen, vocab_size, device)


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _flat_token_index(sequences: list[list[int]], vocab_size: int) -> torch.Tensor:
    """row * vocab + token for every token of every sequence, as a host tensor.

    Built on the host so that the device never has to report an output size back.
    """
    lengths = torch.tensor([len(s) for s in sequences])
    tokens = torch.tensor(list(chain.from_iterable(sequences)), dtype=torch.int64)
    return torch.arange(len(sequences)).repeat_interleave(lengths) * vocab_size + tokens


def _token_counts(sequences: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), vocab] float32: how often each token occurs in each sequence."""
    index = _flat_token_index(sequences, vocab_size).to(device, non_blocking=True)
    counts = torch.zeros(len(sequences) * vocab_size, dtype=torch.float32, device=device)
    counts.index_add_(0, index, torch.ones(len(index), dtype=torch.float32, device=device))
    return counts.view(len(sequences), vocab_size)


def _token_mask(sequences: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), vocab] bool: which tokens occur in each sequence."""
    index = _flat_token_index(sequences, vocab_size).to(device, non_blocking=True)
    mask = torch.zeros(len(sequences) * vocab_size, dtype=torch.bool, device=device)
    return mask.index_fill_(0, index, True).view(len(sequences), vocab_size)
