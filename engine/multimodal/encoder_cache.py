"""EncoderCacheManager (vLLM's): the scheduler's bookkeeping of the images whose embeddings the model runner holds.

Its budget is in embedding tokens. An image's embeddings are computed once and named by its content hash: every
request that needs them while they are held reads them (across its prefill chunks, and across requests with the
same image). An entry no request needs any more stays, freeable, so a later request with the same image still hits
it, and is evicted only when a new image needs its room; the runner drops what was evicted (get_freed_mm_hashes).
With keep_unused off, such an entry is evicted at once: images are shared only by requests that need them together.
"""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class EncoderCacheStats:
    """Cumulative: images looked up when a step needed their embeddings, those already held, those computed."""

    queries: int = 0
    hits: int = 0
    computed: int = 0


class EncoderCacheManager:
    def __init__(self, cache_size: int, keep_unused: bool = True):
        self.cache_size = cache_size
        self.keep_unused = keep_unused
        self.num_free_slots = cache_size
        # Free slots plus those of entries no request needs (evictable on demand).
        self.num_freeable_slots = cache_size
        # Content hash -> the ids of the requests that need its embeddings (empty: freeable).
        self.cached: dict[str, set[str]] = {}
        # Entries no request needs, oldest first: hash -> its embedding tokens.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        # Evicted since the last step: the runner drops their embeddings.
        self.freed: list[str] = []
        self.stats = EncoderCacheStats()

    def check_and_update_cache(self, request, input_id: int) -> bool:
        """Whether the embeddings of the request's input_id-th image are held (computed, or scheduled this step);
        if so the request now holds them too."""
        mm_hash = request.mm_features[input_id].identifier
        self.stats.queries += 1
        if mm_hash not in self.cached:
            return False
        if not self.cached[mm_hash]:  # nobody needed it: it is no longer freeable
            num_tokens = self.freeable.pop(mm_hash)
            self.num_freeable_slots -= num_tokens
        self.cached[mm_hash].add(request.request_id)
        self.stats.hits += 1
        return True

    def can_allocate(self, request, input_id: int, encoder_compute_budget: int, num_tokens_to_schedule: int) -> bool:
        """Whether the image fits this step's encoder budget (less num_tokens_to_schedule already taken) and the
        cache, evicting freeable entries, oldest first, as far as needed."""
        num_tokens = request.mm_features[input_id].num_embeds
        if num_tokens > encoder_compute_budget:
            return False
        num_tokens += num_tokens_to_schedule
        if num_tokens <= self.num_free_slots:
            return True
        if num_tokens > self.num_freeable_slots:
            return False
        while num_tokens > self.num_free_slots:
            mm_hash, num_free = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_free
        return True

    def allocate(self, request, input_id: int) -> None:
        """Room for the image's embeddings, which the runner computes in this step."""
        feature = request.mm_features[input_id]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.num_free_slots -= feature.num_embeds
        self.num_freeable_slots -= feature.num_embeds
        self.stats.computed += 1

    def get_cached_input_ids(self, request) -> set[int]:
        return {i for i, f in enumerate(request.mm_features) if request.request_id in self.cached.get(f.identifier, ())}

    def free_encoder_input(self, request, input_id: int) -> None:
        """The request no longer needs this image's embeddings (its placeholders are in the KV cache, or it ended);
        the last one out makes the entry freeable."""
        feature = request.mm_features[input_id]
        holders = self.cached.get(feature.identifier)
        if holders is None or request.request_id not in holders:
            return
        holders.discard(request.request_id)
        if holders:
            return
        self.num_freeable_slots += feature.num_embeds
        if self.keep_unused:
            self.freeable[feature.identifier] = feature.num_embeds
        else:
            del self.cached[feature.identifier]
            self.freed.append(feature.identifier)
            self.num_free_slots += feature.num_embeds

    def free(self, request) -> None:
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def usage(self) -> float:
        """Share of the cache that requests need now (freeable entries count as free)."""
        return 1.0 - self.num_freeable_slots / self.cache_size if self.cache_size else 0.0
