"""--batch-invariant on against off on the embedded model in --dtype auto: a 512-token prefill, a decode step of 1
and of 16 requests, in ms. Each variant runs in processes of its own (two engines in one process slow each other
unevenly), on and off alternating; medians.

    .venv/bin/python benchmarks/batch_invariance.py
"""

import json
import statistics
import subprocess
import sys
import time

PROCESSES, ROUNDS, DECODE_STEPS = 3, 3, 16
CASES = ("prefill 512", "decode 1", "decode 16")


def measure(variant):
    import torch

    from engine.config import EngineArgs
    from engine.core import EngineCore
    from engine.request import Request, SamplingParams

    engine, times, ids = (
        EngineCore(EngineArgs(dtype="auto", batch_invariant=variant)),
        {c: [] for c in CASES},
        iter(range(10**9)),
    )

    def add(n, prompt_len, max_tokens):
        for _ in range(n):
            i = next(ids)
            prompt = torch.randint(100, 40000, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(Request(f"r{i}", prompt, params, cache_salt=f"{variant}{i}"))

    def timed_step():
        start = time.perf_counter()
        engine.step()
        return (time.perf_counter() - start) * 1e3

    def drain():
        while engine.has_unfinished_requests():
            engine.step()

    for _ in range(ROUNDS):
        add(1, 512, 1)
        times["prefill 512"].append(timed_step())
        drain()
        for n in (1, 16):
            add(n, 32, DECODE_STEPS + 2)
            engine.step()  # the prompts
            times[f"decode {n}"] += [timed_step() for _ in range(DECODE_STEPS)]
            drain()
    return times


if len(sys.argv) > 1:
    print(json.dumps(measure(sys.argv[1])))
    sys.exit()
# Each variant in processes of its own: two engines in one process slow each other unevenly.
times = {(v, c): [] for v in ("on", "off") for c in CASES}
for _ in range(PROCESSES):
    for v in ("on", "off"):
        out = subprocess.run([sys.executable, __file__, v], check=True, capture_output=True, text=True).stdout
        for case, values in json.loads(out.splitlines()[-1]).items():
            times[v, case] += values
for case in CASES:
    on, off = (statistics.median(times[v, case]) for v in ("on", "off"))
    print(f"{case:12s} on {on:8.2f} ms  off {off:8.2f} ms  on/off {on / off:.3f}")
