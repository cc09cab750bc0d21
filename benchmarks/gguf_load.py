"""GGUF load benchmark: the engine's load of a Qwen3, Phi-3, Gemma 2 and Gemma 3 GGUF against transformers'
from_pretrained(gguf_file=...) of the same file.

    .venv/bin/python benchmarks/gguf_load.py [--size tiny|small|medium] [--families qwen3 phi3 gemma2 gemma3]
        [--quant f32|q8_0] [--rounds 3]

Each family's file is written locally from a random model of that architecture (never downloaded), as llama.cpp's
converter writes it (tests/test_gguf_families.py's writer); --size picks its shape: tiny (a smoke run, seconds),
small (~100 MB of float32) or medium (~400 MB). Per round, alternating which goes first: the engine cold (the
one-time conversion into an empty cache, then the model built and its weights loaded), the engine cached (the
conversion reused), and transformers. Reported: each variant's median seconds over rounds and transformers' median
over each of the engine's.
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SIZES = {  # hidden, intermediate, layers, heads, kv heads
    "tiny": (64, 96, 2, 4, 2),
    "small": (512, 1408, 8, 8, 4),
    "medium": (1024, 2816, 8, 8, 4),
}


def write_model(family: str, size: str, quant: str, path: Path) -> None:
    from test_gguf_families import _tiny_model, _vocab, write_gguf

    hidden, inter, layers, heads, kv = SIZES[size]
    vocab = _vocab(family)
    shape = {"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
             "num_key_value_heads": kv}  # fmt: skip
    if family != "gemma3":  # Gemma 3 keeps its six layers (one of each kind)
        shape["num_hidden_layers"] = layers
    if family in ("qwen3", "gemma2", "gemma3"):
        shape["head_dim"] = 128 if family == "qwen3" else hidden // heads
    if family == "gemma3":
        shape["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    if family == "gemma2":
        shape["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    if family == "qwen3":  # set after the config is built, so its layer_types must be given the new length too
        shape["layer_types"] = ["full_attention"] * layers
    model = _tiny_model(family, len(vocab["tokens"]), **shape)
    write_gguf(path, family, model, vocab, quantized=quant == "q8_0")


def engine_load(path: Path, cache: Path) -> float:
    import os

    from engine.config import EngineArgs
    from engine.core import EngineCore

    os.environ["LLMMESH_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    EngineCore(EngineArgs(model=str(path), dtype="float32", kv_cache_memory="16MiB"))
    return time.perf_counter() - start


def transformers_load(path: Path) -> float:
    import torch
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM

    # transformers refuses GGUF without `accelerate` installed, but its GGUF path does not use it on CPU.
    transformers.modeling_utils.is_accelerate_available = lambda *a, **k: True
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return time.perf_counter() - start


def bench_family(family: str, size: str, quant: str, rounds: int, work: Path) -> dict:
    path = work / family / f"{family}.gguf"
    path.parent.mkdir(parents=True)
    write_model(family, size, quant, path)
    times = {"engine_cold": [], "engine_cached": [], "transformers": []}
    for r in range(rounds):
        cache = work / family / f"cache-{r}"

        def engine():
            times["engine_cold"].append(engine_load(path, cache))
            times["engine_cached"].append(engine_load(path, cache))

        def hf():
            times["transformers"].append(transformers_load(path))

        for run in (engine, hf) if r % 2 == 0 else (hf, engine):
            run()
        shutil.rmtree(cache)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "family": family,
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "seconds": times,
        "median_s": medians,
        "transformers_over_engine_cold": medians["transformers"] / medians["engine_cold"],
        "transformers_over_engine_cached": medians["transformers"] / medians["engine_cached"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--families", nargs="+", default=["qwen3", "phi3", "gemma2", "gemma3"])
    ap.add_argument("--quant", choices=["f32", "q8_0"], default="f32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from engine.models.files import GGUF_ARCHS
    from engine.models.registry import ModelRegistry

    with tempfile.TemporaryDirectory(prefix="gguf-load-") as tmp:
        for family in args.families:
            if not ModelRegistry.is_supported(GGUF_ARCHS[family]):
                print(json.dumps({"family": family, "skipped": f"{GGUF_ARCHS[family]} is not implemented"}))
                continue
            result = bench_family(family, args.size, args.quant, args.rounds, Path(tmp))
            print(json.dumps({"size": args.size, "quant": args.quant, **result}))


if __name__ == "__main__":
    main()
