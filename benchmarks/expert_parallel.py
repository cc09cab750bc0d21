"""Expert parallelism: a decode step's time with --enable-expert-parallel over 2 ranks, against one rank and against
--tensor-parallel-size 2 without it, same model, same steps.

    .venv/bin/python benchmarks/expert_parallel.py [--rounds 5] [--steps 16] [--layers 8] [--experts 8]

The model is a random Mixtral (hidden 512, 8 heads and 4 KV heads, --experts experts of width 1024, two a token),
float32. Each configuration is an engine in a process of its own (two engines with ranks cannot share one process's
process group), all three started first and then asked in turn, round after round, the order alternating (the
machine is shared and noisy); each waits idle while another runs. Scenarios, each a step the engine really runs:
  decode-1    one request decoding (context 128)
  decode-16   sixteen requests decoding (context 128 each)
Medians are printed, with the ratios EP=2 / one rank and EP=2 / TP=2 (above 1: slower). On CPU the two ranks split
the cores; on CUDA each rank is a device (NCCL).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tensor_parallel import decode_step_s

from engine.config import EngineArgs
from engine.core import EngineCore
from random_model import save_word_level_tokenizer

# Each configuration: the engine's parallel settings.
CONFIGS = {
    "one": {"tensor_parallel_size": 1},
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}
SCENARIOS = {"decode-1": 1, "decode-16": 16}
RESULT = "RESULT "  # the prefix of a server's answers on stdout (anything else there is the engine's)


def save_model(path: Path, layers: int, experts: int) -> None:
    import torch
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024,
        initializer_range=0.05, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    save_word_level_tokenizer(path, config.vocab_size)


def serve(name: str, model: str) -> None:
    """One configuration's engine: warms up, then answers each "SCENARIO STEPS" line on stdin with the median
    step time until stdin closes."""
    args = EngineArgs(
        model=model, dtype="float32", kv_cache_memory="256MiB", enable_prefix_caching=False, **CONFIGS[name]
    )
    engine = EngineCore(args)
    try:
        for batch in SCENARIOS.values():  # oneDNN's first calls, the allocator
            decode_step_s(engine, batch, 2)
        print(RESULT + "ready", flush=True)
        for line in sys.stdin:
            scenario, steps = line.split()
            print(RESULT + json.dumps(decode_step_s(engine, SCENARIOS[scenario], int(steps))), flush=True)
    finally:
        engine.shutdown()


def start_server(script: str, name: str, model: str) -> subprocess.Popen:
    """`script --serve name --model model`: one configuration's engine, asked on stdin and answering on stdout."""
    command = [sys.executable, script, "--serve", name, "--model", model]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def answer(proc: subprocess.Popen) -> str:
    for line in proc.stdout:
        if line.startswith(RESULT):
            return line.removeprefix(RESULT).strip()
    raise RuntimeError(f"the benchmark's engine process {proc.args} ended (code {proc.wait()})")


def ask(proc: subprocess.Popen, question: str) -> str:
    proc.stdin.write(question + "\n")
    proc.stdin.flush()
    return answer(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--serve", choices=sorted(CONFIGS), help=argparse.SUPPRESS)  # one configuration's process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.model)
        return
    times = {(scenario, name): [] for scenario in SCENARIOS for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp), args.layers, args.experts)
        procs = {name: start_server(__file__, name, tmp) for name in CONFIGS}
        try:
            for proc in procs.values():
                assert answer(proc) == "ready"
            for round_ in range(args.rounds):
                order = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
                for scenario in SCENARIOS:
                    for name in order:
                        times[scenario, name].append(float(ask(procs[name], f"{scenario} {args.steps}")))
        finally:
            for proc in procs.values():
                proc.stdin.close()
            for proc in procs.values():
                proc.wait()
    result = {"load_average": os.getloadavg(), "cores": os.cpu_count(), "layers": args.layers, "experts": args.experts}
    for scenario in SCENARIOS:
        one, tp2, ep2 = (statistics.median(times[scenario, name]) for name in CONFIGS)
        result[scenario] = {
            "one_ms": round(one * 1e3, 2),
            "tp2_ms": round(tp2 * 1e3, 2),
            "ep2_ms": round(ep2 * 1e3, 2),
            "ep2_over_one": round(ep2 / one, 2),
            "ep2_over_tp2": round(ep2 / tp2, 2),
        }
        print(
            f"{scenario:10s} one {one * 1e3:8.2f} ms   TP=2 {tp2 * 1e3:8.2f} ms   EP=2 {ep2 * 1e3:8.2f} ms   "
            f"EP/one {ep2 / one:5.2f}x   EP/TP {ep2 / tp2:5.2f}x"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
