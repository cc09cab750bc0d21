"""The products of a decode step's few rows: kernels/cpu/dense.cpp's dense_linear against oneDNN's own kernel, both
on oneDNN's packed weight, in bfloat16 or float32; in float32 where the CPU has the codes kernel (AVX2, no AVX-512),
also dense_codes_linear on 4-bit codes of the same weights (GGUF Q4_1's form: groups of 32, float16 scales).

    .venv/bin/python benchmarks/dense_linear.py [--dtype bfloat16] [--rows 1,2,4,8,16] [--batch-size 1,4,8]
        [--rounds 7] [--model DIR]

Isolated: SmolLM2-135M's 120 products of a decode step (a layer: qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576), every layer with its own random weights, so that each comes from memory as in the engine; each row
count is timed in rounds alternating the kernels, after a warm-up round of every count; medians. With codes, each
weight is the dequantized 4-bit codes of a random one, so all three kernels compute the same products.
Engine: greedy decode of --batch-size requests at once (64-token prompts, 128 output tokens, EOS ignored) on
SmolLM2 in --dtype, unquantized; a step's time is the decode time over its 127 steps. Rounds alternate the engine
as it runs and the same engine with quantization.DENSE_MAX_ROWS empty (oneDNN alone); medians.
--model: a Hugging Face directory of weights; by default the embedded GGUF's weights as transformers dequantizes
them, written once to build/smollm2-bf16 (float32 runs them widened, the same values).
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import run_batch

from engine.config import EngineArgs, parse_int_list
from engine.core import EngineCore
from engine.models import quantization
from engine.models.files import DEFAULT_MODEL, resolve_model
from engine.models.loader import prepare_model_dir
from kernels.dense import dense_codes_kernel, dense_kernel, pack_codes, packed_view
from kernels.quant import dequantize, quantize_int4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's [N, K] a layer
LAYERS = 30
BF16_DIR = Path(__file__).resolve().parent.parent / "build" / "smollm2-bf16"


def isolated(rows: list[int], rounds: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    codes_kernel = dense_codes_kernel() if dtype == torch.float32 else None
    packed, views, codes = [], [], []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randn(n, k)
            if codes_kernel is not None:
                q, scales, zeros = quantize_int4(w, 32)
                codes.append(pack_codes(q, scales, zeros))
                w = dequantize(q, scales, zeros)
            w = w.to(dtype)
            packed.append(torch.ops.mkldnn._reorder_linear_weight(w, None))
            views.append(packed_view(packed[-1], w))
    shapes = SHAPES * LAYERS
    dense = dense_kernel(dtype)
    kernels = ["oneDNN", "dense_linear"] + (["codes"] if codes_kernel is not None else [])

    def step(x: dict[int, torch.Tensor], kernel: str) -> float:
        started = time.perf_counter()
        for i, ((n, k), p, v) in enumerate(zip(shapes, packed, views)):
            if kernel == "oneDNN":
                torch.ops.mkldnn._linear_pointwise(x[k], p, None, "none", [], "")
            elif kernel == "codes":
                codes_kernel(x[k], *codes[i], 32, n)
            else:
                dense(x[k], v, n, None)
        return (time.perf_counter() - started) * 1000

    inputs = {m: {k: torch.randn(m, k).to(dtype) for k in (576, 1536)} for m in rows}
    for m in rows:
        for kernel in kernels:
            step(inputs[m], kernel)
    nbytes = sum(dtype.itemsize * n * k for n, k in shapes)
    codes_bytes = sum(t.nbytes for layer in codes for t in layer[:3])
    for m in rows:
        times = {kernel: [] for kernel in kernels}
        for _ in range(rounds):
            for kernel in kernels:
                times[kernel].append(step(inputs[m], kernel))
        ours, theirs = statistics.median(times["dense_linear"]), statistics.median(times["oneDNN"])
        line = (
            f"isolated {m:2d} rows: oneDNN {theirs:6.2f} ms ({nbytes / theirs / 1e6:4.1f} GB/s), dense_linear "
            f"{ours:6.2f} ms ({nbytes / ours / 1e6:4.1f} GB/s), {theirs / ours:.2f}x"
        )
        if codes:
            on_codes = statistics.median(times["codes"])
            line += (
                f"; codes {on_codes:6.2f} ms ({codes_bytes / on_codes / 1e6:4.1f} GB/s of {codes_bytes / 1e6:.0f} MB), "
                f"{on_codes / ours:.2f} of dense_linear's time"
            )
        print(line, flush=True)


def bfloat16_smollm2() -> Path:
    """The embedded SmolLM2 as a Hugging Face directory of bfloat16 weights (transformers' dequantization)."""
    if (BF16_DIR / "model.safetensors").exists():
        return BF16_DIR
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf = resolve_model(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    converted = prepare_model_dir(DEFAULT_MODEL)  # its config and tokenizer, without the GGUF's quantization
    BF16_DIR.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (converted / name).exists():
            (BF16_DIR / name).write_bytes((converted / name).read_bytes())
    config = json.loads((converted / "config.json").read_text())
    config.pop("quantization_config", None)
    (BF16_DIR / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(weights, str(BF16_DIR / "model.safetensors"), metadata={"format": "pt"})
    return BF16_DIR


def engine(model: str, batches: list[int], rounds: int, dtype: torch.dtype, input_len=64, output_len=128) -> None:
    core = EngineCore(EngineArgs(model=model, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(batches)))
    views = [m.packed_dense for m in core.worker.model.modules() if getattr(m, "packed_dense", None) is not None]
    max_rows = quantization.DENSE_MAX_ROWS.get((dtype, views[0].shape[2]), 0) if views else 0
    print(f"engine: {len(views)} layers on dense_linear up to {max_rows} rows", flush=True)
    rng = random.Random(0)
    modes = {"dense_linear": quantization.DENSE_MAX_ROWS, "oneDNN": {}}
    for max_rows in modes.values():
        quantization.DENSE_MAX_ROWS = max_rows
        for batch in batches:
            run_batch(core, batch, 16, 8, rng)
    steps = {(mode, b): [] for mode in modes for b in batches}
    for _ in range(rounds):
        for batch in batches:
            for mode, max_rows in modes.items():
                quantization.DENSE_MAX_ROWS = max_rows
                _, decode_s = run_batch(core, batch, input_len, output_len, rng)
                steps[mode, batch].append(decode_s / (output_len - 1) * 1000)
    quantization.DENSE_MAX_ROWS = modes["dense_linear"]
    for batch in batches:
        ours, theirs = statistics.median(steps["dense_linear", batch]), statistics.median(steps["oneDNN", batch])
        print(
            f"engine batch {batch}: decode step oneDNN {theirs:.2f} ms, dense_linear {ours:.2f} ms, {theirs / ours:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_int_list, default=[1, 2, 4, 8, 16], help="isolated row counts; '' none")
    parser.add_argument("--batch-size", type=parse_int_list, default=[1, 4, 8], help="engine batch sizes; '' none")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (medians)")
    parser.add_argument("--model", help="a Hugging Face directory of weights (default: build/smollm2-bf16)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the products' dtype")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if dense_kernel(dtype) is None:
        raise SystemExit(f"dense_linear in {args.dtype} needs a CPU with AVX-512 (AVX512-BF16 for bfloat16)")
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads", flush=True)
    if args.rows:
        isolated(args.rows, args.rounds, dtype)
    if args.batch_size:
        engine(args.model or str(bfloat16_smollm2()), args.batch_size, args.rounds, dtype)


if __name__ == "__main__":
    main()
