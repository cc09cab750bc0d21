"""Tensor parallelism: per-step time with --tensor-parallel-size 2 against 1, same model, same steps.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 5] [--layers 30] [--batch-invariant-at N]

The model is random, SmolLM2-135M's shape but with 8 heads and 4 KV heads (head_dim 72), so that both divide
by 2 (SmolLM2's own 9 and 3 divide by 3 only). float32, on CPU over gloo. --batch-invariant-at N compares
--batch-invariant on against off at TP=N instead, on SmolLM2's own 9 and 3 heads where N is 3: with more than two
ranks, `on` sums each all-reduce's parts in rank order (engine/distributed/parallel_state.py), `off` keeps gloo's
ring. Scenarios, each a step the engine really runs (EngineCore.step), timed after a warm-up:
  decode-1    one request decoding (context 128)
  decode-16   sixteen requests decoding (context 128 each)
  prefill-512 one 512-token prompt in one step
The variants alternate round after round (the machine is shared and noisy); medians are printed, with the
ratio of the second to the first (above 1: slower).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams
from random_model import save_random_smollm2_shaped

CONTEXT = 128


def decode_step_s(engine: EngineCore, batch: int, steps: int) -> float:
    """Median seconds of a decode step of `batch` requests."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            Request(f"d{batch}-{i}-{time.monotonic_ns()}", [3 + (i + t) % 500 for t in range(CONTEXT)], params)
        )
    engine.step()  # the prompts
    times = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times[:steps])


def prefill_step_s(engine: EngineCore, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request(Request(f"p-{time.monotonic_ns()}", [3 + t % 500 for t in range(tokens)], params))
    began = time.perf_counter()
    engine.step()
    took = time.perf_counter() - began
    while engine.has_unfinished_requests():
        engine.step()
    return took


SCENARIOS = {
    "decode-1": lambda e, steps: decode_step_s(e, 1, steps),
    "decode-16": lambda e, steps: decode_step_s(e, 16, steps),
    "prefill-512": lambda e, steps: prefill_step_s(e, 512),
}


def alternate_rounds(engine_args: dict, scenarios: dict, rounds: int, steps: int) -> tuple[dict, dict]:
    """Each (scenario, variant) timed `rounds` times, the variants alternating within each round after a warm-up:
    ({(scenario, variant): [seconds]}, {variant: the threads it ran with}). A process holds one group of ranks, so
    where more than one variant has several, each runs in turn in each round, started and warmed up anew."""
    together = sum(args.tensor_parallel_size > 1 for args in engine_args.values()) <= 1
    engines, threads = {}, {}
    times = {(name, variant): [] for name in scenarios for variant in engine_args}

    def start(variant: str, warm_ups) -> EngineCore:
        engine = engines[variant] = EngineCore(engine_args[variant])
        # Threads are the process's: rank 0 of two ranks takes half the cores (the other rank the rest), one rank all.
        threads[variant] = torch.get_num_threads()
        for run in warm_ups:  # oneDNN's first calls, the allocator
            run(engine, 2)
        return engine

    try:
        if together:
            for variant in engine_args:
                start(variant, scenarios.values())
        for _ in range(rounds):
            for name, run in scenarios.items():
                for variant in engine_args:
                    engine = engines[variant] if together else start(variant, [run])
                    torch.set_num_threads(threads[variant])
                    times[name, variant].append(run(engine, steps))
                    if not together:
                        engines.pop(variant).shutdown()
    finally:
        for engine in engines.values():
            engine.shutdown()
    return times, threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument(
        "--batch-invariant-at", type=int, default=0, metavar="N",
        help="compare --batch-invariant on against off at TP=N (the ratio on / off), instead of TP=1 against TP=2",
    )  # fmt: skip
    args = parser.parse_args()
    size = args.batch_invariant_at
    if size:
        variants = {f"TP={size} {s}": {"tensor_parallel_size": size, "batch_invariant": s} for s in ("off", "on")}
        heads = (9, 3)
    else:
        variants = {f"TP={s}": {"tensor_parallel_size": s} for s in (1, 2)}
        heads = (8, 4)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        save_random_smollm2_shaped(
            model, num_attention_heads=heads[0], num_key_value_heads=heads[1], num_hidden_layers=args.layers,
            max_position_embeddings=2048,
        )  # fmt: skip
        engine_args = {
            name: EngineArgs(
                model=str(model), dtype="float32", kv_cache_memory="256MiB", enable_prefix_caching=False, **variant
            )
            for name, variant in variants.items()
        }
        times, threads = alternate_rounds(engine_args, SCENARIOS, args.rounds, args.steps)
    result = {"load_average": os.getloadavg(), "cores": os.cpu_count(), "layers": args.layers, "threads": threads}
    first, second = variants
    for name in SCENARIOS:
        a, b = (statistics.median(times[name, variant]) for variant in (first, second))
        result[name] = {f"{first} ms": round(a * 1e3, 2), f"{second} ms": round(b * 1e3, 2), "ratio": round(b / a, 2)}
        print(f"{name:12s} {first} {a * 1e3:8.2f} ms   {second} {b * 1e3:8.2f} ms   {second} / {first} {b / a:5.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
