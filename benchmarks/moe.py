"""The mixture-of-experts layer on the CPU, alone and in a model's decode.

    .venv/bin/python benchmarks/moe.py [--tokens 1,16,64] [--batch-size 1,16] [--rounds 7] [--dtype bfloat16]
        [--quick]

Layer: LAYERS FusedMoE layers of the model's expert shape (64 experts, 8 of them a token, hidden 1024, expert width
384), each with its own random weights, so that each comes from memory as in a model. A timing is PASSES passes of
--tokens tokens through every layer, three ways on the same weights and router logits: FusedMoE on the C++ CPU kernel
(kernels/cpu/moe.cpp, as the engine runs it), FusedMoE on the grouped torch fused_experts, and a plain loop over the
experts in torch (transformers' way: each expert picks out its tokens, one matmul pair an expert). Rounds alternate
the three; the report is each one's median time a layer.

Engine: greedy decode of --batch-size requests at once (64-token prompts, 64 output tokens, EOS ignored) through
EngineCore on two random-weight models: Qwen3-MoE-shaped (LAYERS layers, hidden 1024, 16 query and 4 KV heads of
64, 64 experts of width 384, 8 a token) and a dense Qwen3 of the same attention with an MLP of width 8 * 384, the
same active parameters a token. Both are saved once under build/moe-bench/. Rounds alternate the two models; the
report is each one's median decode tokens/s and the MoE's over the dense's.

--quick: a tiny shape (its models in a temporary directory), one round, a few tokens: that the script runs end to
end; its figures mean nothing.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from latency import run_batch

from engine.config import EngineArgs, parse_int_list
from engine.core import EngineCore
from engine.models.fused_moe import FusedMoE, fused_topk
from engine.models.layers import silu_and_mul
from kernels.cpu_ops import try_load
from random_model import save_word_level_tokenizer

LAYERS = 4
PASSES = 5  # passes through the layers a timing: a 1-token layer takes tens of microseconds
SHAPE = dict(hidden_size=1024, num_experts=64, top_k=8, moe_intermediate_size=384, vocab_size=8192, heads=(16, 4, 64))
QUICK = dict(hidden_size=128, num_experts=64, top_k=8, moe_intermediate_size=32, vocab_size=512, heads=(4, 2, 32))
BENCH_DIR = Path(__file__).resolve().parent.parent / "build" / "moe-bench"


def per_expert_loop(moe: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The experts as transformers runs them: for each expert some token picked, its tokens picked out by mask."""
    topk_weights, topk_ids = fused_topk(router_logits, moe.top_k, moe.renormalize)
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        h = silu_and_mul(F.linear(x[token], moe.w13_weight[expert]))
        y = F.linear(h, moe.w2_weight[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def layer(shape: dict, tokens: list[int], rounds: int, dtype: torch.dtype) -> None:
    ops = try_load()
    if ops is None:
        raise SystemExit("the C++ CPU kernels cannot be built here")
    hidden, experts, width = shape["hidden_size"], shape["num_experts"], shape["moe_intermediate_size"]
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        moe = FusedMoE(experts, shape["top_k"], hidden, width, renormalize=True)
        with torch.no_grad():
            moe.w13_weight.copy_(torch.randn(experts, 2 * width, hidden) / hidden**0.5)
            moe.w2_weight.copy_(torch.randn(experts, hidden, width) / width**0.5)
        layers.append(moe.to(dtype))

    def forward(moe, x, logits, way):
        if way == "loop":
            return per_expert_loop(moe, x, logits)
        moe.ops = ops if way == "kernel" else None
        return moe(x, logits)

    def run(inputs, way) -> float:
        started = time.perf_counter()
        for _ in range(PASSES):
            for moe, (x, logits) in zip(layers, inputs):
                forward(moe, x, logits, way)
        return (time.perf_counter() - started) * 1000 / (PASSES * LAYERS)

    ways = ["kernel", "grouped", "loop"]
    inputs = {n: [(torch.randn(n, hidden).to(dtype), torch.randn(n, experts)) for _ in layers] for n in tokens}
    for n in tokens:  # warm-up, and the three agree (up to rounding) on the same inputs
        x, logits = inputs[n][0]
        outs = [forward(layers[0], x, logits, way).float() for way in ways]
        print(
            f"{n} tokens: max |kernel - grouped| {(outs[0] - outs[1]).abs().max():.2e}, max |loop - grouped| "
            f"{(outs[2] - outs[1]).abs().max():.2e}",
            flush=True,
        )
    with torch.no_grad():
        for n in tokens:
            times = {way: [] for way in ways}
            for _ in range(rounds):
                for way in ways:
                    times[way].append(run(inputs[n], way))
            kernel, grouped, loop = (statistics.median(times[way]) for way in ways)
            print(
                f"layer, {n:2d} tokens: C++ kernel {kernel:7.3f} ms, grouped torch {grouped:7.3f} ms, per-expert loop "
                f"{loop:7.3f} ms; kernel {loop / kernel:.2f}x the loop, {grouped / kernel:.2f}x the grouped torch",
                flush=True,
            )


def save_models(shape: dict, layers: int, directory: Path) -> tuple[Path, Path]:
    """The Qwen3-MoE-shaped model and its dense twin of the same active parameters, saved once (bfloat16)."""
    import transformers

    num_heads, num_kv_heads, head_dim = shape["heads"]
    common = dict(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    active_width = shape["top_k"] * shape["moe_intermediate_size"]
    configs = {
        "moe": transformers.Qwen3MoeConfig(
            **common,
            num_experts=shape["num_experts"],
            num_experts_per_tok=shape["top_k"],
            moe_intermediate_size=shape["moe_intermediate_size"],
            intermediate_size=active_width,  # unused: every layer is sparse
            norm_topk_prob=True,
        ),
        "dense": transformers.Qwen3Config(**common, intermediate_size=active_width),
    }
    paths = []
    for name, config in configs.items():
        path = directory / f"{name}-h{shape['hidden_size']}-l{layers}"
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(path)
            save_word_level_tokenizer(path, config.vocab_size)
            del model
        paths.append(path)
    return tuple(paths)


def active_parameters(path: Path, shape: dict) -> float:
    """The checkpoint's parameters a token uses: every tensor, an expert tensor's top_k / num_experts share of it."""
    from safetensors import safe_open

    total = 0.0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                numel = torch.Size(f.get_slice(name).get_shape()).numel()
                total += numel * shape["top_k"] / shape["num_experts"] if ".experts." in name else numel
    return total


def engine(shape, batches: list[int], rounds: int, dtype: str, input_len: int, output_len: int, directory) -> None:
    moe_path, dense_path = save_models(shape, LAYERS, directory)
    engines = {}
    for name, path in (("MoE", moe_path), ("dense", dense_path)):
        args = EngineArgs(model=str(path), dtype=dtype, max_num_seqs=max(batches), kv_cache_memory="256MiB")
        engines[name] = EngineCore(args)
    active = {"MoE": active_parameters(moe_path, shape), "dense": active_parameters(dense_path, shape)}
    print(f"active parameters a token: MoE {active['MoE'] / 1e6:.1f}M, dense {active['dense'] / 1e6:.1f}M", flush=True)
    rng = random.Random(0)
    for core in engines.values():
        for batch in batches:
            run_batch(core, batch, 16, 4, rng)
    tok_s = {(name, b): [] for name in engines for b in batches}
    for _ in range(rounds):
        for batch in batches:
            for name, core in engines.items():
                _, decode_s = run_batch(core, batch, input_len, output_len, rng)
                tok_s[name, batch].append(batch * (output_len - 1) / decode_s)
    for batch in batches:
        moe, dense = statistics.median(tok_s["MoE", batch]), statistics.median(tok_s["dense", batch])
        print(
            f"engine batch {batch:2d}: decode MoE {moe:7.1f} tok/s, dense {dense:7.1f} tok/s, MoE/dense {moe / dense:.2f}"
        )
    for core in engines.values():
        core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=parse_int_list, default=[1, 16, 64], help="layer token counts; '' none")
    parser.add_argument("--batch-size", type=parse_int_list, default=[1, 16], help="engine batch sizes; '' none")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (medians)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and one round: a smoke run")
    args = parser.parse_args()
    shape, rounds, lengths = (QUICK, 1, (8, 4)) if args.quick else (SHAPE, args.rounds, (64, 64))
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads", flush=True)
    if args.tokens:
        layer(shape, args.tokens, rounds, getattr(torch, args.dtype))
    if args.batch_size and args.quick:  # its tiny models are not kept
        with tempfile.TemporaryDirectory() as directory:
            engine(shape, args.batch_size, rounds, args.dtype, *lengths, Path(directory))
    elif args.batch_size:
        engine(shape, args.batch_size, rounds, args.dtype, *lengths, BENCH_DIR)


if __name__ == "__main__":
    main()
