"""Pipeline parallelism: the time of a step of every request with --pipeline-parallel-size 2 against one rank,
same model, same requests.

    .venv/bin/python benchmarks/pipeline_parallel.py [--rounds 5] [--layers 30]

The model is random, SmolLM2-135M's shape (30 layers: 15 a stage), float32, on CPU over gloo. With two stages an
engine step may only put a batch into the pipeline or only take one out, so a step's time says little; what is
timed is a round, the time for every request to get one more token:
  decode-1    one request decoding (context 128): the stages take turns, nothing overlaps
  decode-16   sixteen requests decoding (context 128 each)
  prefill-512 one 512-token prompt, prefilled in chunks of 128 (the chunks overlap in the pipeline), to its first
              token
The sizes alternate round after round (the machine is shared and noisy); medians are printed, with the ratio
PP=2 / one rank (above 1: slower).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tensor_parallel import alternate_rounds

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams
from random_model import save_random_smollm2_shaped

CONTEXT = 128
CHUNK = 128


def decode_round_s(engine: EngineCore, batch: int, rounds: int) -> float:
    """Seconds for each of `batch` decoding requests to get one more token, averaged over `rounds` tokens."""
    params = SamplingParams(temperature=0, max_tokens=rounds + 1, ignore_eos=True)
    ids = [f"d{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(Request(request_id, [3 + (i + t) % 500 for t in range(CONTEXT)], params))
    started: set[str] = set()
    while len(started) < batch:  # the prompts, to every request's first token
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - began) / rounds


def prefill_s(engine: EngineCore, tokens: int) -> float:
    """Seconds from a prompt's arrival to its first token."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request(Request(f"p-{time.monotonic_ns()}", [3 + t % 500 for t in range(tokens)], params))
    began = time.perf_counter()
    while not any(out.new_token_ids for out in engine.step()):
        pass
    took = time.perf_counter() - began
    while engine.has_unfinished_requests():
        engine.step()
    return took


SCENARIOS = {
    "decode-1": lambda e, rounds: decode_round_s(e, 1, rounds),
    "decode-16": lambda e, rounds: decode_round_s(e, 16, rounds),
    "prefill-512": lambda e, rounds: prefill_s(e, 512),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode tokens timed per round")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        save_random_smollm2_shaped(model, num_hidden_layers=args.layers, max_position_embeddings=2048)
        sizes = {
            size: EngineArgs(
                model=str(model), dtype="float32", kv_cache_memory="256MiB", pipeline_parallel_size=size,
                enable_prefix_caching=False, max_num_batched_tokens=CHUNK,
            )
            for size in (1, 2)
        }  # fmt: skip
        times, threads = alternate_rounds(sizes, SCENARIOS, args.rounds, args.steps)
    result = {"load_average": os.getloadavg(), "cores": os.cpu_count(), "layers": args.layers, "threads": threads}
    for name in SCENARIOS:
        one, pp2 = (statistics.median(times[name, size]) for size in (1, 2))
        result[name] = {
            "one_ms": round(one * 1e3, 2),
            "pp2_ms": round(pp2 * 1e3, 2),
            "pp2_over_one": round(pp2 / one, 2),
        }
        print(f"{name:12s} one rank {one * 1e3:8.2f} ms   PP=2 {pp2 * 1e3:8.2f} ms   PP=2/one {pp2 / one:5.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
