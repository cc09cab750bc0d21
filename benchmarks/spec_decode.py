"""Speculative decoding's speed-up: output tokens/s with n-gram drafts and with a draft model against no speculation.

    .venv/bin/python benchmarks/spec_decode.py [--concurrency 1,16] [--rounds 2]
        [--max-tokens 96] [--num-speculative-tokens 3] [--draft-layers 6] [--sequential-prompts 4]
        [--output-json PATH]

Target: SmolLM2-135M-Instruct (the embedded model), greedy (so every engine produces the same tokens). Two
workloads of chat prompts: copying (code edits, quotes and summaries whose answer repeats the prompt's text) and
non-copying (open questions, stories). At concurrency 1 the first --sequential-prompts prompts run one after the
other (each prompt's own figures are printed too: the small model copies some prompts and not others); at
concurrency c > 1, c requests run at once (the prompts repeated); output tokens/s is their output tokens over the
wall time.

Engines, in one process and the same rounds: no speculation, n-gram ({"method": "ngram"}, prompt_lookup 2..4) and a
draft model. SmolLM2-135M is the smallest model with its tokenizer, so the draft is its own first --draft-layers
layers with its final norm and head (an early exit of the target, written as a model directory here): a real second
model with the same vocabulary and its own KV cache, cheaper than the target by the layers it skips. Each round runs
every engine on every workload and concurrency in turn, so the machine's drifts hit all alike; figures are medians
over the rounds, with the acceptance rate (accepted / proposed drafts) and the mean tokens per step of a drafting
request. The machine is shared: figures are shapes, not absolutes.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import DEFAULT_MODEL, EngineArgs, parse_int_list
from engine.core import EngineCore
from engine.models.loader import prepare_model_dir
from engine.request import Request, SamplingParams
from engine.text.tokenizer import Tokenizer

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax'''
TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to five "
    "books at a time for three weeks. Late returns cost ten cents a day per book."
)
COPYING = [
    f"Rename the variable subtotal to base_amount in this code and show the whole function:\n{CODE}",
    f"Repeat this paragraph exactly:\n{TEXT}",
    f"Add a docstring to this function and show the whole function:\n{CODE}",
    f"Rewrite this paragraph, replacing 'books' with 'items' and nothing else:\n{TEXT}",
]
NON_COPYING = [
    "Write a short story about a dragon who learns to bake bread.",
    "What are three good reasons to learn a second language?",
    "Describe a walk through a forest in autumn.",
    "Explain how a bicycle stays upright.",
]


def cpu_name() -> str:
    models = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    return models[0] if models else platform.machine()


def write_early_exit_draft(model_dir: Path, num_layers: int, out: Path) -> Path:
    """The target's first num_layers layers, its embeddings, final norm and head, as a model directory."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = f.get_tensor(name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((model_dir / name).read_bytes())
    return out


def run(engine: EngineCore, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[tuple]:
    """(seconds, output tokens, drafts (proposed, accepted, steps)) of each batch: at concurrency 1 each prompt
    alone, one after the other; else one batch of `concurrency` requests (the prompts repeated)."""
    if concurrency == 1:
        return [run_batch(engine, [p], max_tokens) for p in prompts]
    return [run_batch(engine, [prompts[i % len(prompts)] for i in range(concurrency)], max_tokens)]


def run_batch(engine: EngineCore, batch: list[list[int]], max_tokens: int) -> tuple[float, int, tuple]:
    """Seconds and output tokens for these prompts run at once, and the drafts (proposed, accepted, steps)."""
    stats = engine.get_stats().spec_decoding_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts) if stats else (0, 0, 0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, started = 0, time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(Request(f"{time.perf_counter_ns()}-{i}", prompt, params))
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - started
    stats = engine.get_stats().spec_decoding_stats
    after = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts) if stats else (0, 0, 0)
    return elapsed, tokens, tuple(a - b for a, b in zip(after, before))


def record(results: dict, key: tuple, batches: list[tuple]) -> None:
    """One round's output tokens/s, output tokens and drafts over these batches, under key."""
    elapsed, tokens = sum(b[0] for b in batches), sum(b[1] for b in batches)
    drafts = tuple(sum(b[2][i] for b in batches) for i in range(3))
    results.setdefault(key, []).append((tokens / elapsed, tokens, drafts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=parse_int_list, default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--sequential-prompts", type=int, default=4)
    parser.add_argument("--output-json")
    args = parser.parse_args()

    model_dir = prepare_model_dir(DEFAULT_MODEL)
    tokenizer = Tokenizer.from_pretrained(model_dir)

    def encode(text):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return tokenizer.encode(chat, add_special_tokens=False)

    workloads = {"copying": [encode(p) for p in COPYING], "non-copying": [encode(p) for p in NON_COPYING]}
    k = args.num_speculative_tokens
    draft = write_early_exit_draft(model_dir, args.draft_layers, Path(tempfile.mkdtemp()) / "draft")
    configs = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k},
    }
    engines = {
        name: EngineCore(EngineArgs(kv_cache_memory="512MiB", speculative_config=json.dumps(c) if c else None))
        for name, c in configs.items()
    }
    for engine in engines.values():  # warm-up
        run(engine, workloads["copying"][:1], 1, 8)
    results: dict[tuple, list] = {}
    for round_index in range(args.rounds):
        for workload, prompts in workloads.items():
            for concurrency in args.concurrency:
                for name, engine in engines.items():
                    chosen = prompts[: args.sequential_prompts] if concurrency == 1 else prompts
                    batches = run(engine, chosen, concurrency, args.max_tokens)
                    record(results, (workload, str(concurrency), name), batches)
                    if concurrency == 1 and len(batches) > 1:
                        for i, batch in enumerate(batches):
                            record(results, (workload, f"1, prompt {i + 1}", name), [batch])
        print(f"round {round_index + 1}/{args.rounds} done, load average {os.getloadavg()}", flush=True)

    print(f"\n{cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()}; k = {k}")
    print("| workload | concurrency | engine | output tok/s | vs none | acceptance | tokens / drafting step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    report = []
    for (workload, concurrency, name), runs in sorted(results.items(), key=lambda item: item[0][:2]):
        speed = statistics.median(r[0] for r in runs)
        base = statistics.median(r[0] for r in results[(workload, concurrency, "none")])
        proposed, accepted, steps = (sum(r[2][i] for r in runs) for i in range(3))
        acceptance = f"{accepted / proposed:.0%}" if proposed else "-"
        per_step = f"{1 + accepted / steps:.2f}" if steps else "-"
        print(
            f"| {workload} | {concurrency} | {name} | {speed:.1f} | {speed / base:.2f}x | {acceptance} | {per_step} |"
        )
        report.append(dict(workload=workload, concurrency=concurrency, engine=name, tokens_per_s=speed,
                           speedup=speed / base, proposed=proposed, accepted=accepted, drafting_steps=steps,
                           output_tokens=[r[1] for r in runs]))  # fmt: skip
    if args.output_json:
        machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg()}
        Path(args.output_json).write_text(json.dumps({"machine": machine, "k": k, "results": report}, indent=1))


if __name__ == "__main__":
    main()
