"""Tensor parallelism: per-step time with --tensor-parallel-size 2 against 1, same model, same steps.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 5] [--layers 30]

The model is random, SmolLM2-135M's shape but with 8 heads and 4 KV heads (head_dim 72), so that both divide
by 2 (SmolLM2's own 9 and 3 divide by 3 only). float32, on CPU over gloo. Scenarios, each a step the engine
really runs (EngineCore.step), timed after a warm-up:
  decode-1    one request decoding (context 128)
  decode-16   sixteen requests decoding (context 128 each)
  prefill-512 one 512-token prompt in one step
The sizes alternate round after round (the machine is shared and noisy); medians are printed, with the
ratio TP=2 / TP=1 (above 1: slower).
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
    """Each (scenario, size) timed `rounds` times, the sizes alternating within each round after a warm-up:
    ({(scenario, size): [seconds]}, {size: the threads it ran with})."""
    engines, threads = {}, {}
    for size, args in engine_args.items():
        engines[size] = EngineCore(args)
        # Threads are the process's: rank 0 of two ranks takes half the cores (the other rank the rest), one rank all.
        threads[size] = torch.get_num_threads()
    try:
        for size, engine in engines.items():  # warm-up: oneDNN's first calls, the allocator
            torch.set_num_threads(threads[size])
            for run in scenarios.values():
                run(engine, 2)
        times = {(name, size): [] for name in scenarios for size in engines}
        for _ in range(rounds):
            for name, run in scenarios.items():
                for size, engine in engines.items():
                    torch.set_num_threads(threads[size])
                    times[name, size].append(run(engine, steps))
    finally:
        for engine in engines.values():
            engine.shutdown()
    return times, threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        save_random_smollm2_shaped(
            model, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=args.layers,
            max_position_embeddings=2048,
        )  # fmt: skip
        sizes = {
            size: EngineArgs(
                model=str(model), dtype="float32", kv_cache_memory="256MiB", tensor_parallel_size=size,
                enable_prefix_caching=False,
            )
            for size in (1, 2)
        }  # fmt: skip
        times, threads = alternate_rounds(sizes, SCENARIOS, args.rounds, args.steps)
    result = {"load_average": os.getloadavg(), "cores": os.cpu_count(), "layers": args.layers, "threads": threads}
    for name in SCENARIOS:
        tp1, tp2 = (statistics.median(times[name, size]) for size in (1, 2))
        result[name] = {
            "tp1_ms": round(tp1 * 1e3, 2),
            "tp2_ms": round(tp2 * 1e3, 2),
            "tp2_over_tp1": round(tp2 / tp1, 2),
        }
        print(f"{name:12s} TP=1 {tp1 * 1e3:8.2f} ms   TP=2 {tp2 * 1e3:8.2f} ms   TP=2/TP=1 {tp2 / tp1:5.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
