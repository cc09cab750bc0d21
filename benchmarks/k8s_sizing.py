"""The figures the Kubernetes manifests are sized from (deploy/kubernetes/, docs/deployment.md#kubernetes).

    .venv/bin/python benchmarks/k8s_sizing.py [--model smollm2-135m-instruct] [--parts start,steps,memory]

1. The engine's start, `llmmesh engine` until its gRPC health says SERVING: once with an empty weights cache (the
   GGUF is converted first) and once with the cache that start filled (what the model volume's init step buys).
2. Step times in process: one decode step at 1 and 64 requests, and one prefill step of the whole token budget
   (2,048 tokens, the longest step the default scheduler runs).
3. Each service's memory under `llmmesh serve` after a burst of requests: resident (VmRSS) and peak (VmHWM).
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LLMMESH = [sys.executable, "-m", "services.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_start_seconds(model: str, cache_dir: str) -> float:
    from services.server import check_health

    port = free_port()
    env = dict(os.environ, LLMMESH_CACHE_DIR=cache_dir)
    began = time.perf_counter()
    proc = subprocess.Popen([*LLMMESH, "engine", "--port", str(port), "--model", model], env=env)
    try:
        while not check_health(f"127.0.0.1:{port}", "", 1.0):
            if proc.poll() is not None:
                raise SystemExit(f"the engine exited with {proc.returncode}")
            time.sleep(0.1)
        return time.perf_counter() - began
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def step_seconds(model: str) -> dict[str, float]:
    from engine import LLM, SamplingParams

    llm = LLM(model=model)
    vocab = 1000  # ordinary tokens, clear of the special ones at the start of SmolLM2's vocabulary

    def run(batch: int, prompt_len: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % vocab for j in range(prompt_len)]} for i in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        began = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - began

    run(1, 16, 4)  # warm-up
    figures = {}
    for batch in (1, 64):
        # 17 tokens against 1: the difference is 16 decode steps (each prompt differs, so nothing is cached).
        figures[f"decode step, {batch} requests"] = (run(batch, 32, 17) - run(batch, 33, 1)) / 16
    figures["prefill step, 2,048 tokens"] = run(1, 2047, 1)
    return figures


def serve_memory(model: str) -> dict[str, tuple[float, float]]:
    from services import client

    port = free_port()
    proc = subprocess.Popen(
        [*LLMMESH, "serve", "--port", str(port), "--model", model], stdout=subprocess.PIPE, text=True
    )
    pids = {}
    try:
        for line in proc.stdout:
            print(line, end="")
            if found := re.search(r"the (\S+) is serving: .*\(pid (\d+)", line):
                pids[found[1]] = int(found[2])
            if "gateway listening" in line:
                break
        address = f"127.0.0.1:{port}"

        def request(i: int) -> None:
            client.collect(client.generate(address, f"Request {i}: tell me a story. " * 20, max_tokens=64))

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(request, range(64)))
        return {name: (status_mib(pid, "VmRSS"), status_mib(pid, "VmHWM")) for name, pid in pids.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def status_mib(pid: int, field: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--parts", default="start,steps,memory", help="which of start, steps, memory to measure")
    args = parser.parse_args()
    parts = args.parts.split(",")
    # Each figure is printed as soon as it is measured, with the load it was measured under.
    if "start" in parts:
        with tempfile.TemporaryDirectory() as cache:
            cold = engine_start_seconds(args.model, cache)
            warm = engine_start_seconds(args.model, cache)
        report(f"engine start to SERVING: empty cache {cold:.1f} s, converted cache {warm:.1f} s")
    if "steps" in parts:
        for name, seconds in step_seconds(args.model).items():
            report(f"{name}: {seconds * 1000:.1f} ms")
    if "memory" in parts:
        for name, (rss, peak) in serve_memory(args.model).items():
            report(f"{name}: RSS {rss:.0f} MiB, peak {peak:.0f} MiB")


def report(line: str) -> None:
    print(f"{line} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", flush=True)


if __name__ == "__main__":
    main()
