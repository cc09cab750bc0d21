"""Sliding-window layers on the hybrid KV cache manager against the same model with every layer attending to the
whole context: how many tokens the KV cache holds, and how long a decode step takes at a long context.

    .venv/bin/python benchmarks/hybrid_kv.py [--kv-cache-memory 1GiB] [--context 32768] [--decode-context 16384]
        [--rounds 7] [--steps 16]

The model is a random Gemma 3 of six layers, five sliding-window layers of --window 1,024 to one global layer
(Gemma 3's pattern), 4 query heads and 1 KV head of 256, hidden 512, written once to a temporary directory. The
"full" variant is the same checkpoint with every layer a global one (config.json's layer_types), so both compute
the same work per token apart from attention.

Capacity: each variant's engine sizes its KV cache for --kv-cache-memory; its KVCacheManager then admits requests
of --context tokens, each prefilled in --chunk-token steps as the scheduler would (the blocks a sliding window
leaves behind are freed as it goes) and then making room for its first decoded token, until a step finds no room.
The tokens held are the admitted requests' tokens.

Decode: each variant's engine prefills one request of --decode-context tokens, then both decode in turn, --steps
steps a round for --rounds rounds (the machine is shared and noisy); the medians of the per-step times are printed.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def write_model(path: Path, window: int, max_len: int) -> Path:
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=window,
        max_position_embeddings=max_len,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path / "hybrid")
    full = path / "full"
    full.mkdir()
    for f in (path / "hybrid").iterdir():
        (full / f.name).symlink_to(f)
    (full / "config.json").unlink()
    d = json.loads((path / "hybrid" / "config.json").read_text())
    d["layer_types"] = ["full_attention"] * 6
    (full / "config.json").write_text(json.dumps(d))
    return path


def make_engine(model: Path, args, max_num_batched_tokens: int):
    from engine.config import EngineArgs
    from engine.core import EngineCore

    return EngineCore(
        EngineArgs(
            model=str(model),
            dtype="float32",
            kv_cache_memory=args.kv_cache_memory,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=args.max_len,
        )
    )


def tokens_held(engine, context: int, chunk: int) -> int:
    """Requests of `context` tokens admitted chunk by chunk into the engine's own KVCacheManager, each then making
    room for its first decoded token (which frees what its prefill's last chunk left outside a window), until one
    finds no room; the tokens of those wholly admitted."""
    from engine.request import Request, SamplingParams

    manager = engine.kv_cache_manager
    gen = torch.Generator().manual_seed(0)
    held = 0
    for i in range(10_000):
        request = Request(f"r{i}", torch.randint(3, 2048, (context,), generator=gen).tolist(), SamplingParams())
        for start in range(0, context, chunk):
            if manager.allocate_slots(request, min(chunk, context - start)) is None:
                return held
            request.num_computed_tokens = min(start + chunk, context)
        request.append_output_token_ids(0)
        if manager.allocate_slots(request, 1) is None:
            return held
        held += context
    return held


def time_decode(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--decode-context", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    args.max_len = max(args.context, args.decode_context) + args.rounds * args.steps + 64
    from engine.request import Request, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        root = write_model(Path(tmp), args.window, args.max_len)
        variants = ("hybrid", "full")
        print(f"capacity at a {args.context}-token context, --kv-cache-memory {args.kv_cache_memory}:")
        held = {}
        for name in variants:
            engine = make_engine(root / name, args, args.chunk)
            held[name] = tokens_held(engine, args.context, args.chunk)
            blocks = engine.kv_cache_manager.num_blocks
            print(f"  {name:6s} {blocks} blocks, {held[name]} tokens ({held[name] // args.context} requests)")
            engine.shutdown()
        print(f"  hybrid holds {held['hybrid'] / max(held['full'], 1):.2f}x the tokens of full attention")

        engines = {}
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, 2048, (args.decode_context,), generator=gen).tolist()
        for name in variants:
            engine = make_engine(root / name, args, args.chunk)
            params = SamplingParams(temperature=0, max_tokens=args.rounds * args.steps + 8, ignore_eos=True)
            engine.add_request(Request("decode", prompt, params))
            began = time.perf_counter()
            while engine.scheduler.requests["decode"].num_output_tokens == 0:
                engine.step()
            print(f"{name} prefill of {args.decode_context} tokens: {time.perf_counter() - began:.1f} s")
            engines[name] = engine
        per_step = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name in variants:
                per_step[name].append(statistics.median(time_decode(engines[name], args.steps)))
        medians = {name: statistics.median(v) for name, v in per_step.items()}
        print(f"decode step at a {args.decode_context}-token context (medians of {args.rounds} rounds):")
        for name in variants:
            print(f"  {name:6s} {medians[name] * 1e3:.2f} ms")
        print(f"  full / hybrid step time: {medians['full'] / medians['hybrid']:.2f}")
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
