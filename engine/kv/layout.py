"""What one KV block is outside the paged cache (KVLayout), and the fingerprint that says which engines' blocks are
interchangeable. A model has one layout per KV cache group (engine.kv.kv_cache_spec): a group's block holds only its
own layers, and its fingerprint names the group (index, spec, layers), so blocks of different groups, or of engines
that group layers otherwise, never mix. Multi-head latent attention keeps one latent vector a token and layer in place
of per-head K and V: its block is [layers, block size, kv_lora_rank + qk_rope_head_dim]. The worker builds the
layouts; every KV connector moves blocks of them. Torch-free."""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from engine.kv.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec

# The KV cache dtypes (--kv-cache-dtype), by torch name.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class KVLayout:
    """One block of one KV cache group as raw bytes of `shape`: [the group's layers, 2 (K, V), kv heads, block size,
    head dim], or with MLA [the group's layers, block size, kv_lora_rank + qk_rope_head_dim] (block_shape)."""

    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    # With tensor parallelism each rank holds its own heads of a block: every rank's fingerprint, in rank order (a
    # block is in a store only if each rank's shard is). Empty on one rank.
    shard_fingerprints: tuple[str, ...] = ()
    # The KV cache group: its index, its spec, and the model layers its block holds, in order (empty: every layer).
    group_id: int = 0
    kv_cache_spec: KVCacheSpec = FullAttentionSpec()
    layer_ids: tuple[int, ...] = ()

    @property
    def all_fingerprints(self) -> tuple[str, ...]:
        """The fingerprints a whole block is stored under: every rank's shard, or the one."""
        return self.shard_fingerprints or (self.fingerprint,)

    @property
    def is_mla(self) -> bool:
        return isinstance(self.kv_cache_spec, MLAAttentionSpec)

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def block_size(self) -> int:
        return self.shape[1] if self.is_mla else self.shape[3]

    @property
    def block_bytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def weights_digest(model_dir: Path) -> str:
    """sha256 over the config and every weight file, cached beside them by size and modification time."""
    files = sorted(
        p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors", ".gguf") and not p.name.startswith(".")
    )
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    cache = model_dir / ".llmmesh-weights-digest.json"
    try:
        saved = json.loads(cache.read_text())
        if saved["stamp"] == [list(s) for s in stamp]:
            return saved["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    value = digest.hexdigest()
    try:
        cache.write_text(json.dumps({"stamp": stamp, "digest": value}))
    except OSError:
        pass  # a read-only model directory: hash again next time
    return value


def block_shape(
    spec: KVCacheSpec, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int
) -> tuple[int, ...]:
    """A KVLayout's shape for a group of num_layers layers: MLA's latent vectors, or K and V per head."""
    if isinstance(spec, MLAAttentionSpec):
        return (num_layers, block_size, spec.head_size)
    return (num_layers, 2, num_kv_heads, block_size, head_dim)


def spec_name(spec: KVCacheSpec) -> str:
    """ "full", "sliding:W" or "mla:R+P" (kv_lora_rank, qk_rope_head_dim), as fingerprints and logs name a group's
    spec."""
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding:{spec.sliding_window}"
    if isinstance(spec, MLAAttentionSpec):
        return f"mla:{spec.kv_lora_rank}+{spec.qk_rope_head_dim}"
    return "full"


def model_fingerprint(
    weights: str,
    dtype: str,
    kv_layout: str,
    shape: tuple[int, ...],
    hash_algo: str,
    rank: int = 0,
    world_size: int = 1,
    group_id: int = 0,
    spec: KVCacheSpec = FullAttentionSpec(),  # noqa: B008 (frozen)
    layer_ids: tuple[int, ...] = (),
) -> str:
    """64 hex characters naming everything that makes two engines' blocks of one KV cache group interchangeable."""
    identity = {
        "kv_cache_group": {"index": group_id, "spec": spec_name(spec), "layers": list(layer_ids)},
        "weights": weights,
        "dtype": dtype,
        "kv_layout": kv_layout,
        "shape": list(shape),
        "hash_algo": hash_algo,
        "rank": rank,
        "world_size": world_size,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
