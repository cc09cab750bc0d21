"""Pipeline parallelism: the time for every request to get one more token with --pipeline-parallel-size 2 against
one rank, same model, same requests.

    .venv/bin/python benchmarks/pipeline_parallel.py [--rounds 5] [--steps 16] [--layers 30]

The model is random, SmolLM2-135M's shape (30 layers: 15 a stage), float32, on CPU over gloo, with a token budget of
128 a step. Three configurations: one rank on every core, one rank on one thread, and two stages (each rank on
half the cores: one thread each on two cores), so that the last two differ by the stage hand-off and the overlap
alone. Each is an engine in a process of its own (the model runner asks its process which pipeline stage it is,
so a one-rank engine cannot share a process with stages), all started first and then asked in turn, round after
round, the order alternating (the machine is shared and noisy); each waits idle while another runs.

With two stages an engine step may only put a batch into the pipeline or only take one out, so a step's time says
little; what is timed is a round, the time for every request to get one more token:
  decode-1    one request decoding (context 128): the stages take turns, nothing overlaps
  decode-16   sixteen requests decoding (context 128 each), timed once all have their first token; their prompts
              go in one a step, so their decodes fall into batches that may overlap in the pipeline
  prefill-512 one 512-token prompt, prefilled in chunks of 128 (the chunks overlap in the pipeline), to its first
              token
Medians are printed, with the ratios PP=2 / one rank (above 1: slower) and the mean number of batches in flight
after each timed step of the pipeline (1: the stages take turns; 2: both stages have a batch).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from expert_parallel import RESULT, answer, ask, start_server

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams
from random_model import save_random_smollm2_shaped

CONTEXT = 128
CHUNK = 128
# Each configuration: (--pipeline-parallel-size, torch threads; None: the engine's own choice).
CONFIGS = {"one": (1, None), "one-1thread": (1, 1), "pp2": (2, None)}


class TimedSteps:
    """Steps an engine, counting each request's new tokens and the batches in flight after each step."""

    def __init__(self, engine: EngineCore):
        self.engine, self.tokens, self.in_flight = engine, {}, []

    def step(self) -> None:
        for out in self.engine.step():
            if out.new_token_ids:
                self.tokens[out.request_id] = self.tokens.get(out.request_id, 0) + len(out.new_token_ids)
        self.in_flight.append(self.engine.last_step.num_batches_in_flight)

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def decode_round_s(engine: EngineCore, batch: int, rounds: int) -> tuple[float, float]:
    """Seconds for each of `batch` decoding requests to get one more token, over `rounds` tokens once every request
    has its first; and the mean batches in flight meanwhile."""
    # More tokens than the rounds need: the requests are aborted once timed, so none ends (and shrinks the batch)
    # while the others are timed.
    params = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True)
    ids = [f"d{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(Request(request_id, [3 + (i + t) % 500 for t in range(CONTEXT)], params))
    steps = TimedSteps(engine)
    while len(steps.tokens) < batch:  # the prompts, to every request's first token
        steps.step()
    first, steps.in_flight = dict(steps.tokens), []
    began = time.perf_counter()
    while min(steps.tokens[r] - first[r] for r in ids) < rounds:
        steps.step()
    took = time.perf_counter() - began
    engine.abort_requests(ids)
    steps.drain()
    return took / rounds, statistics.mean(steps.in_flight)


def prefill_s(engine: EngineCore, tokens: int) -> tuple[float, float]:
    """Seconds from a prompt's arrival to its first token, and the mean batches in flight meanwhile."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request(Request(f"p-{time.monotonic_ns()}", [3 + t % 500 for t in range(tokens)], params))
    steps = TimedSteps(engine)
    began = time.perf_counter()
    while not steps.tokens:
        steps.step()
    took = time.perf_counter() - began
    steps.drain()
    return took, statistics.mean(steps.in_flight)


SCENARIOS = {
    "decode-1": lambda e, rounds: decode_round_s(e, 1, rounds),
    "decode-16": lambda e, rounds: decode_round_s(e, 16, rounds),
    "prefill-512": lambda e, rounds: prefill_s(e, 512),
}


def serve(name: str, model: str) -> None:
    """One configuration's engine: warms up, then answers each "SCENARIO ROUNDS" line on stdin with the scenario's
    seconds and batches in flight until stdin closes."""
    size, threads = CONFIGS[name]
    if threads:
        torch.set_num_threads(threads)
    engine = EngineCore(
        EngineArgs(
            model=model, dtype="float32", kv_cache_memory="256MiB", pipeline_parallel_size=size,
            enable_prefix_caching=False, max_num_batched_tokens=CHUNK,
        )
    )  # fmt: skip
    try:
        for run in SCENARIOS.values():  # oneDNN's first calls, the allocator
            run(engine, 2)
        # Rank 0 of two stages takes half the cores (the other stage the rest), one rank all unless told.
        print(RESULT + json.dumps({"threads": torch.get_num_threads()}), flush=True)
        for line in sys.stdin:
            scenario, rounds = line.split()
            print(RESULT + json.dumps(SCENARIOS[scenario](engine, int(rounds))), flush=True)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode tokens timed per round")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--serve", choices=sorted(CONFIGS), help=argparse.SUPPRESS)  # one configuration's process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.model)
        return
    names = list(CONFIGS)
    times = {(scenario, name): [] for scenario in SCENARIOS for name in names}
    in_flight = {(scenario, name): [] for scenario in SCENARIOS for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        save_random_smollm2_shaped(Path(tmp), num_hidden_layers=args.layers, max_position_embeddings=2048)
        procs = {name: start_server(__file__, name, tmp) for name in names}
        try:
            threads = {name: json.loads(answer(proc))["threads"] for name, proc in procs.items()}
            for round_ in range(args.rounds):
                order = names if round_ % 2 == 0 else names[::-1]
                for scenario in SCENARIOS:
                    for name in order:
                        seconds, batches = json.loads(ask(procs[name], f"{scenario} {args.steps}"))
                        times[scenario, name].append(seconds)
                        in_flight[scenario, name].append(batches)
        finally:
            for proc in procs.values():
                proc.stdin.close()
            for proc in procs.values():
                proc.wait()
    result = {"load_average": os.getloadavg(), "cores": os.cpu_count(), "layers": args.layers, "threads": threads}
    for scenario in SCENARIOS:
        one, one_1t, pp2 = (statistics.median(times[scenario, name]) for name in names)
        batches = statistics.mean(in_flight[scenario, "pp2"])
        result[scenario] = {
            "one_ms": round(one * 1e3, 2),
            "one_1thread_ms": round(one_1t * 1e3, 2),
            "pp2_ms": round(pp2 * 1e3, 2),
            "pp2_over_one": round(pp2 / one, 2),
            "pp2_over_one_1thread": round(pp2 / one_1t, 2),
            "pp2_batches_in_flight": round(batches, 2),
        }
        print(
            f"{scenario:12s} one rank {one * 1e3:8.2f} ms   one rank, 1 thread {one_1t * 1e3:8.2f} ms   "
            f"PP=2 {pp2 * 1e3:8.2f} ms   PP=2/one {pp2 / one:5.2f}x   PP=2/one 1 thread {pp2 / one_1t:5.2f}x   "
            f"PP=2 batches in flight {batches:4.2f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
