"""Multi-LoRA serving: output tokens/s of one batch spread over 1, 4 and 16 adapters against the base model alone.

    .venv/bin/python benchmarks/lora.py [--rounds 3] [--max-tokens 32] [--dtype float32] [--lora-dtype auto]
        [--output-json PATH]

The model is SmolLM2-135M, its weights dequantized to a dense float32 checkpoint once (so that the base, the merged
and the LoRA engines run the same kernels), run in --dtype (float32, or bfloat16: what the engine picks by default
on a CPU with AMX or AVX512-BF16). The batch: 32 requests, prompts of 32 random token ids,
greedy, exactly --max-tokens output tokens each (ignore_eos), all added at once (LLM.generate).

Systems, each built once before the timing:
  base         an engine without --enable-lora
  merged       one adapter (rank 16) merged into the weights (W + B A alpha/r), no --enable-lora: the way to
               serve a single adapter
  lora-N-rR    an engine with --enable-lora --max-loras 16 --max-lora-rank 16 --lora-dtype D, one for each rank
               R and holding its 16 adapters in host memory and slots: the steady state of serving them, no
               adapter read again or copied into a slot during the timing; the batch's requests cycle over N
               random adapters (PEFT directories) of rank R on all seven projections (request i: adapter i % N)
The systems alternate within every round (the machine is shared and noisy) and each one's median over the
rounds is printed, with its ratio to the base model's, and its decode step: the batch timed again with one output
token (the prefill alone), the difference spread over the other --max-tokens - 1 steps. Last, the CPU kernel
alone, 32 decode tokens over 16 adapters of rank 16 (two tokens each) in the slots' dtype: one q/k/v layer's delta
with the tokens in adapter order and interleaved (as the batch has them; the same time if each adapter's weights
are read once), against the gathered bmm of the torch reference; and a whole decode step's 120 wrapped layers,
each with its own slots, so that every weight comes from memory as in the engine: back to back, and each after its
layer's base product (the engine's Linear on random weights of the model's shapes), as the engine runs them, where
the base weights' reads between the calls leave none of the slots in the caches (the difference to the base
products alone).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.peft import SUPPORTED_TARGET_MODULES, module_shapes
from engine.models.files import load_config
from engine.models.linear import Linear
from engine.models.loader import DEFAULT_MODEL, load_weights, prepare_model_dir
from kernels.lora import lora_cpu_kernel, lora_expand_ref, lora_kernel_meta, lora_shrink_ref

NUM_REQUESTS = 32
PROMPT_LEN = 32
ADAPTER_COUNTS = (1, 4, 16)
RANKS = (8, 16)
ALPHA = 16


def save_dense_model(out: Path) -> Path:
    """SmolLM2 dequantized to plain float32 safetensors, with its config and tokenizer."""
    src = prepare_model_dir(DEFAULT_MODEL)
    out.mkdir(parents=True)
    save_file(
        {name: t.float().contiguous() for name, t in load_weights(src, dequantized=True)}, out / "model.safetensors"
    )
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(src / name, out / name)
    return out


def save_random_adapter(path: Path, model_dir: Path, rank: int, seed: int) -> dict:
    """A random PEFT adapter on all seven projections; its tensors, by PEFT key."""
    cfg = load_config(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (fan_in, fan_out) in module_shapes(cfg).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA, "target_modules": list(SUPPORTED_TARGET_MODULES)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return tensors


def save_merged_model(out: Path, dense: Path, adapter: dict, rank: int) -> Path:
    """The dense model with the adapter merged into its weights."""
    shutil.copytree(dense, out)
    weights = dict(load_weights(dense))
    for key, a in adapter.items():
        if key.endswith("lora_A.weight"):
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            b = adapter[key.replace("lora_A", "lora_B")]
            weights[name] = weights[name] + (b @ a) * (ALPHA / rank)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors")
    return out


def time_cpu_paths(dtype: torch.dtype, lora_dtype: torch.dtype, repeats: int = 30) -> dict[str, float]:
    """Microseconds of the CPU kernel on a decode batch (32 tokens, 16 adapters of rank 16, two tokens each, x in
    dtype, slots in lora_dtype): one q/k/v layer's delta three ways, and a decode step's 120 wrapped layers."""
    cfg = load_config(prepare_model_dir(DEFAULT_MODEL))
    shapes = module_shapes(cfg)
    rank, kernel = 16, lora_cpu_kernel()
    ranks = torch.full((16,), rank)
    sorted_, interleaved = torch.arange(NUM_REQUESTS) // 2, torch.arange(NUM_REQUESTS) % 16

    def layer(modules):  # one wrapped layer's slots and batch
        fan_in, out_sizes = shapes[modules[0]][0], [shapes[m][1] for m in modules]
        a = torch.randn(16, len(modules) * rank, fan_in).to(lora_dtype)
        b = torch.randn(16, rank, sum(out_sizes)).to(lora_dtype)
        x, y = torch.randn(NUM_REQUESTS, fan_in, dtype=dtype), torch.zeros(NUM_REQUESTS, sum(out_sizes), dtype=dtype)
        return x, y, a, b, out_sizes

    x, y, a, b, out_sizes = layer(("q_proj", "k_proj", "v_proj"))
    packed = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    step = [layer(modules) for _ in range(cfg.num_hidden_layers) for modules in packed]
    meta = {"sorted": lora_kernel_meta(sorted_), "interleaved": lora_kernel_meta(interleaved)}

    # Each wrapped layer's base product (the engine's Linear, random weights): the step the kernel runs in, whose
    # weights stream through the caches between its calls.
    base_layers = []
    for x_, y_, _, _, _ in step:
        base = Linear(x_.shape[1], y_.shape[1])
        base.weight.data = torch.randn(y_.shape[1], x_.shape[1]) / x_.shape[1] ** 0.5
        base.quant_method.process_weights_after_loading(base, dtype)
        base_layers.append(base)

    def decode_step(with_base=False, with_kernel=True):
        for (x_, y_, a_, b_, sizes), base in zip(step, base_layers):
            if with_base:
                base(x_)
            if with_kernel:
                kernel(x_, y_, a_, b_, *meta["interleaved"], ranks, sizes)

    paths = {
        "qkv-kernel-sorted": lambda: kernel(x, y, a, b, *meta["sorted"], ranks, out_sizes),
        "qkv-kernel-interleaved": lambda: kernel(x, y, a, b, *meta["interleaved"], ranks, out_sizes),
        "qkv-gathered-bmm": lambda: lora_expand_ref(lora_shrink_ref(x, a, interleaved), b, interleaved, y, out_sizes),
        "decode-step-120-layers": decode_step,
        "decode-step-120-base-products": lambda: decode_step(with_base=True, with_kernel=False),
        "decode-step-120-base-products-and-layers": lambda: decode_step(with_base=True),
    }
    times = {name: [] for name in paths}
    for name, path in paths.items():  # each path alone, after a first call: the q/k/v layer's slots stay in cache
        path()
        for _ in range(repeats):
            began = time.perf_counter()
            path()
            times[name].append((time.perf_counter() - began) * 1e6)
    medians = {name: statistics.median(t) for name, t in times.items()}
    medians["decode-step-120-layers-among-base-products"] = (
        medians["decode-step-120-base-products-and-layers"] - medians["decode-step-120-base-products"]
    )
    return medians


def run_batch(llm: LLM, prompts, max_tokens: int, loras) -> tuple[float, float]:
    """Seconds and output tokens/s of one batch."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    began = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - began
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="the engines' dtype (float32 or bfloat16)")
    parser.add_argument("--lora-dtype", default="auto", help="the adapter slots' dtype (auto: --dtype, or bfloat16)")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    rng = random.Random(0)
    prompts = [[rng.randrange(17, 49152) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    common = dict(dtype=args.dtype, kv_cache_memory="512MiB", max_num_seqs=NUM_REQUESTS)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dense = save_dense_model(tmp / "dense")
        adapters = {}  # (rank, i) -> LoRARequest
        first_r16 = None
        for rank in RANKS:
            for i in range(max(ADAPTER_COUNTS)):
                path = tmp / f"r{rank}-{i}"
                tensors = save_random_adapter(path, dense, rank, seed=rank * 100 + i)
                if rank == 16 and i == 0:
                    first_r16 = tensors
                adapters[rank, i] = LoRARequest(f"r{rank}-{i}", len(adapters) + 1, str(path))
        merged = save_merged_model(tmp / "merged", dense, first_r16, 16)
        engines = {"base": LLM(str(dense), **common), "merged": LLM(str(merged), **common)}
        lora_args = dict(enable_lora=True, max_loras=16, max_lora_rank=16, lora_dtype=args.lora_dtype)
        for rank in RANKS:
            engines[f"lora-r{rank}"] = LLM(str(dense), **lora_args, **common)
            for i in range(max(ADAPTER_COUNTS)):
                engines[f"lora-r{rank}"].add_lora(adapters[rank, i])
        systems = {"base": ("base", None), "merged": ("merged", None)}
        for rank in RANKS:
            for n in ADAPTER_COUNTS:
                loras = [adapters[rank, i % n] for i in range(NUM_REQUESTS)]
                systems[f"lora-{n}-r{rank}"] = (f"lora-r{rank}", loras)
        for engine, loras in systems.values():  # warm-up: every adapter into its slot
            run_batch(engines[engine], prompts, 2, loras)
        results = {name: [] for name in systems}
        step_ms = {name: [] for name in systems}
        for round_ in range(args.rounds):
            for name, (engine, loras) in systems.items():
                elapsed, tok_s = run_batch(engines[engine], prompts, args.max_tokens, loras)
                prefill, _ = run_batch(engines[engine], prompts, 1, loras)
                results[name].append(tok_s)
                step_ms[name].append((elapsed - prefill) / (args.max_tokens - 1) * 1e3)
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()), flush=True)
    medians = {name: statistics.median(v) for name, v in results.items()}
    step_medians = {name: statistics.median(v) for name, v in step_ms.items()}
    print(f"\n{'system':<14} {'output tok/s':>12} {'x base':>7} {'decode step ms':>15}")
    for name, value in medians.items():
        print(f"{name:<14} {value:>12.1f} {value / medians['base']:>7.2f} {step_medians[name]:>15.1f}")
    lora_dtype = args.dtype if args.lora_dtype == "auto" else args.lora_dtype
    cpu_paths = time_cpu_paths(getattr(torch, args.dtype), getattr(torch, lora_dtype))
    print(
        f"the CPU kernel, 32 decode tokens over 16 adapters of rank 16, slots in {lora_dtype}: "
        + ", ".join(f"{name} {us:.0f} us" for name, us in cpu_paths.items())
    )
    print(f"dtype {args.dtype}, lora dtype {args.lora_dtype}, load average: {os.getloadavg()}")
    if args.output_json:
        report = {
            "dtype": args.dtype,
            "lora_dtype": args.lora_dtype,
            "runs": results,
            "medians": medians,
            "decode_step_ms": step_medians,
            "cpu_paths_us": cpu_paths,
        }
        args.output_json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
