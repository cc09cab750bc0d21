"""Latency of one batch at a time, like `vllm bench latency`, against llama.cpp's llama-batched-bench in the same run.

    .venv/bin/python benchmarks/latency.py [--batch-size 1,16,64] [--input-len 256] [--output-len 128]
        [--rounds 3] [--threads N] [--baseline-dtype float32] [--llama-batched-bench PATH]
        [--vllm default,tuned] [--batch-invariant on,off] [--output-json PATH]
        [any engine flag: --dtype, --quantization, --model, ...]

Each run: --batch-size requests at once, each --input-len random token ids (seeded by --seed) and exactly
--output-len greedy tokens (EOS ignored), the shape of llama-batched-bench (-npp, -ntg, -npl, prompts not shared).
Prefill tokens/s: batch * input_len over the time until every request has its first token. Decode tokens/s:
batch * (output_len - 1) over the time from then to the last token (llama-batched-bench: batch * output_len over
its output_len decode passes after the prompt). One warm-up run per engine and batch size first.

Engines, in the same process and the same rounds: the engine flags given (e.g. --dtype bfloat16, a GGUF's native
quantization), the same model with --baseline-dtype and no --quantization (float32: a GGUF dequantized), and
llama-batched-bench on the same .gguf file (`make llama-cpp` builds it) with the same threads. Each round runs every
batch size on every engine in turn, the engines' order reversed every other round, so the machine's slow drifts hit
all alike; the report is each figure's median. --batch-invariant on,off runs the engine in each setting, as two
engines of the same rounds (docs/determinism.md).
--vllm adds vLLM's CPU backend (`make vllm-cpu`) at its defaults and tuned (benchmarks/vllm_peer.py), on --model,
which must then be a safetensors checkpoint (`benchmarks/vllm_peer.py --save-checkpoint DIR` writes SmolLM2's).
"""

import argparse
import dataclasses
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

from engine.config import EngineArgs, parse_int_list
from engine.config.utils import parse_memory_size
from engine.core import EngineCore
from engine.models.files import resolve_model
from engine.request import Request, SamplingParams

FIRST_REGULAR_ID = 17  # SmolLM2's special tokens are ids 0..16
REQUEST_IDS = itertools.count()
LLAMA_BATCHED_BENCH = Path(__file__).resolve().parent.parent / "build/llama-cpp/build/bin/llama-batched-bench"


def run_batch(engine, batch: int, input_len: int, output_len: int, rng: random.Random) -> tuple[float, float]:
    """(prefill s, decode s) of one batch of random prompts driven step by step."""
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(input_len)] for _ in range(batch)]
    return run_prompts(engine, prompts, output_len)


def run_prompts(engine, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(prefill s, decode s) of these prompts at once, driven step by step."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    waiting = set()
    for prompt in prompts:
        request_id = f"r{next(REQUEST_IDS)}"
        waiting.add(request_id)
        engine.add_request(Request(request_id, prompt, params))
    started, prefilled = time.perf_counter(), None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                waiting.discard(out.request_id)
        if prefilled is None and not waiting:
            prefilled = time.perf_counter()
    return prefilled - started, time.perf_counter() - prefilled


class Ours:
    def __init__(self, name: str, engine_args: EngineArgs):
        self.name, self.engine = name, EngineCore(engine_args)
        self.rng = random.Random(engine_args.seed)
        self.config = {
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            "quantization": engine_args.quantization,
            "batch_invariant": engine_args.batch_invariant,
        }

    def warm_up(self, batch: int, input_len: int) -> None:
        run_batch(self.engine, batch, min(input_len, 16), 4, self.rng)

    def run(self, batch: int, input_len: int, output_len: int) -> tuple[float, float]:
        prefill_s, decode_s = run_batch(self.engine, batch, input_len, output_len, self.rng)
        return batch * input_len / prefill_s, batch * (output_len - 1) / decode_s


class Vllm:
    """vLLM's CPU backend in a worker of its venv (benchmarks/vllm_peer.py), driven step by step as Ours is."""

    def __init__(self, variant: str, model_dir: Path, dtype: str, seed: int, kv_gib: int | None, vllm_args: str):
        from vllm_peer import VllmPeer

        self.peer = VllmPeer(variant, model_dir, dtype, seed, kv_gib, vllm_args)
        self.name, self.config, self.rng = self.peer.name, self.peer.config, random.Random(seed)
        self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def warm_up(self, batch: int, input_len: int) -> None:
        self.peer.batch(self.prompts(batch, min(input_len, 16)), 4)

    def prompts(self, batch: int, input_len: int) -> list[list[int]]:
        return [[self.rng.randrange(FIRST_REGULAR_ID, self.vocab) for _ in range(input_len)] for _ in range(batch)]

    def run(self, batch: int, input_len: int, output_len: int) -> tuple[float, float]:
        prefill_s, decode_s = self.peer.batch(self.prompts(batch, input_len), output_len)
        return batch * input_len / prefill_s, batch * (output_len - 1) / decode_s


class LlamaCpp:
    """llama-batched-bench, one process per batch size (its own warm-up included)."""

    name = "llama.cpp"

    def __init__(self, binary: Path, gguf: Path, threads: int):
        self.binary, self.gguf, self.threads = binary, gguf, threads
        self.config = {"binary": str(binary), "gguf": gguf.name, "threads": threads}

    def warm_up(self, batch: int, input_len: int) -> None:
        pass

    def run(self, batch: int, input_len: int, output_len: int) -> tuple[float, float]:
        # -c: the KV cache of every sequence's prompt and output; -b/-ub: llama-batched-bench's documented defaults.
        command = [
            str(self.binary),
            "-m",
            str(self.gguf),
            "-t",
            str(self.threads),
            "-c",
            str(batch * (input_len + output_len)),
        ]
        command += ["-b", "2048", "-ub", "512", "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(batch)]
        out = subprocess.run(command + ["--output-format", "jsonl"], capture_output=True, text=True, check=True).stdout
        row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        return row["speed_pp"], row["speed_tg"]


def batch_invariant_list(value: str) -> list[str]:
    variants = value.split(",")
    if not variants or set(variants) - {"on", "off"}:
        raise argparse.ArgumentTypeError(f"--batch-invariant takes on, off or both (on,off), not {value!r}")
    return variants


def add_batch_invariant_variants(parser: argparse.ArgumentParser) -> None:
    """The engine flag --batch-invariant (on or off) as a list of settings, each an engine of the same run; the
    parser needs conflict_handler="resolve" to take it over from EngineArgs.add_cli_args."""
    parser.add_argument(
        "--batch-invariant",
        type=batch_invariant_list,
        default=["on"],
        help="on, off, or both (on,off): the engine in each setting, alternating in the same run",
    )


def variant_args(args: argparse.Namespace) -> list[EngineArgs]:
    """The engine's arguments in each --batch-invariant setting asked for."""
    return [
        EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "batch_invariant": v}))
        for v in args.batch_invariant
    ]


def cpu_name() -> str:
    models = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    return models[0] if models else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve"
    )
    parser.add_argument("--batch-size", type=parse_int_list, default=[1, 16, 64], help="batch sizes, e.g. 1,16,64")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine at every batch size (medians)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads of every engine")
    parser.add_argument(
        "--baseline-dtype",
        default="float32",
        help="a second engine: the same model in this dtype, unquantized; '' none",
    )
    parser.add_argument(
        "--llama-batched-bench",
        default=str(LLAMA_BATCHED_BENCH),
        help="llama.cpp's llama-batched-bench (`make llama-cpp`), run on the same .gguf file; '' none",
    )
    parser.add_argument("--vllm", default="", help="vLLM's CPU backend variants, from default,tuned; '' none")
    parser.add_argument("--vllm-args", default="{}", help="further keyword arguments of vLLM's LLM, as JSON")
    parser.add_argument("--output-json", help="write the results here too")
    EngineArgs.add_cli_args(parser)
    add_batch_invariant_variants(parser)
    args = parser.parse_args()
    if args.output_len < 2 or args.input_len < 1 or args.rounds < 1:
        parser.error("--output-len must be at least 2, --input-len and --rounds at least 1")
    torch.set_num_threads(args.threads)
    variants = variant_args(args)
    for variant in variants:
        variant.max_num_seqs = max(variant.max_num_seqs, max(args.batch_size))
    engine_args = variants[0]
    if len(variants) == 1:
        engines = [Ours("llmmesh", engine_args)]
    else:
        engines = [Ours(f"llmmesh invariant {v.batch_invariant}", v) for v in variants]
    if args.baseline_dtype:
        baseline = dataclasses.replace(engine_args, dtype=args.baseline_dtype, quantization=None)
        engines.append(Ours(f"llmmesh {args.baseline_dtype}", baseline))
    if args.llama_batched_bench:
        gguf = resolve_model(engine_args.model)
        if gguf.suffix != ".gguf":
            raise SystemExit(f"llama-batched-bench needs a .gguf model, not {gguf}; pass --llama-batched-bench ''")
        if not os.access(args.llama_batched_bench, os.X_OK):
            raise SystemExit(f"{args.llama_batched_bench} is missing: `make llama-cpp` builds it")
        engines.append(LlamaCpp(Path(args.llama_batched_bench), gguf, args.threads))
    for variant in [v for v in args.vllm.split(",") if v]:
        model_dir = resolve_model(engine_args.model)
        if not model_dir.is_dir():
            raise SystemExit(f"--vllm needs --model to be a safetensors checkpoint, not {engine_args.model}")
        # The engine's --kv-cache-memory, in whole GiB, for vLLM's too; unset, vLLM's default.
        kv = engine_args.kv_cache_memory and -(-parse_memory_size(engine_args.kv_cache_memory) // 2**30)
        dtype = str(engines[0].engine.dtype).removeprefix("torch.")
        engines.append(Vllm(variant, model_dir, dtype, args.seed, kv or None, args.vllm_args))
    for engine in engines:
        for batch in args.batch_size:
            engine.warm_up(batch, args.input_len)

    runs = {(e.name, b): [] for e in engines for b in args.batch_size}
    for round_index in range(args.rounds):
        for batch in args.batch_size:
            for engine in engines if round_index % 2 == 0 else engines[::-1]:
                prefill, decode = engine.run(batch, args.input_len, args.output_len)
                runs[engine.name, batch].append({"prefill_tok_s": prefill, "decode_tok_s": decode})
                print(
                    f"round {round_index + 1} batch {batch:3d} {engine.name:21s} prefill {prefill:8.1f} tok/s"
                    f"  decode {decode:7.1f} tok/s",
                    flush=True,
                )
    for engine in engines:
        if isinstance(engine, Vllm):
            engine.peer.close()
    rows = []
    for engine in engines:
        for batch in args.batch_size:
            mine = runs[engine.name, batch]
            row = {"engine": engine.name, "batch_size": batch, "rounds": mine}
            for key in ("prefill_tok_s", "decode_tok_s"):
                row[key] = statistics.median(r[key] for r in mine)
            rows.append(row)
            print(
                f"median batch {batch:3d} {engine.name:21s} prefill {row['prefill_tok_s']:8.1f} tok/s"
                f"  decode {row['decode_tok_s']:7.1f} tok/s"
            )
    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg()},
        "threads": args.threads,
        "engines": {e.name: e.config for e in engines},
        "shape": {"input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds},
        "results": rows,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
