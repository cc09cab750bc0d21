"""What one KV block is outside the paged cache (KVLayout), and the fingerprint that says which engines' blocks are
interchangeable. The worker builds the layout; every KV connector moves blocks of it. Torch-free."""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

# The KV cache dtypes (--kv-cache-dtype), by torch name.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class KVLayout:
    """One block as raw bytes of `shape` = [layers, 2 (K, V), kv heads, block size, head dim]."""

    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    # With tensor parallelism each rank holds its own heads of a block: every rank's fingerprint, in rank order (a
    # block is in a store only if each rank's shard is). Empty on one rank.
    shard_fingerprints: tuple[str, ...] = ()

    @property
    def all_fingerprints(self) -> tuple[str, ...]:
        """The fingerprints a whole block is stored under: every rank's shard, or the one."""
        return self.shard_fingerprints or (self.fingerprint,)

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def block_size(self) -> int:
        return self.shape[3]

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


def model_fingerprint(
    weights: str, dtype: str, kv_layout: str, shape: tuple[int, ...], hash_algo: str, rank: int = 0, world_size: int = 1
) -> str:
    """64 hex characters naming everything that makes two engines' blocks interchangeable."""
    identity = {
        "weights": weights,
        "dtype": dtype,
        "kv_layout": kv_layout,
        "shape": list(shape),
        "hash_algo": hash_algo,
        "rank": rank,
        "world_size": world_size,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
