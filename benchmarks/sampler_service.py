"""The sampler service's cost: the engine sampling over gRPC against sampling in process.

    .venv/bin/python benchmarks/sampler_service.py [--streams 1,32,128] [--rounds 3] [--output-len 64]
        [--sampling greedy|typical] [--hop-batches 1,64,256] [--hop-iters 20] [--skip-throughput] [--skip-hop]
        [--serve-concurrency 1,32,64,256] [--serve-control] [--step-parts 1,32,64,256] [--output-json PATH]

Throughput: one offline LLM (SmolLM2, CPU) runs `streams` requests at once (prompts of 32 random token ids,
`--output-len` tokens each, ignore_eos; --sampling greedy, or typical: temperature 0.7 / top_p 0.95 with a seed
each), sampling in process and on a sampler service (`llmmesh sampler`, its own process, over TCP loopback, the
logits in shared memory as the engine sends them) in alternating rounds on the same EngineCore; output tokens/s
of each, and the ratio per round. Both runs give the same tokens (checked).

Hop: RemoteSampler.sample against the in-process Sampler on the same random float32 logits [batch, vocab]
(the same per-row settings as above), at each --hop-batches size: bytes on the wire per step, and ms per
step (median over --hop-iters after warm-up; each iteration times every form in turn), with the logits as bytes
over TCP loopback and over a Unix domain socket, and in shared memory with the step over the step channel (as the
engine sends it: a greedy step for greedy rows, else the protobuf) and over the stream on TCP loopback (as without
the channel); plus the
engine's own decode step at that batch (in-process sampling) and its scheduling, input-building and update
parts, for the break-even, and the next step's allocation and input building that async scheduling does while
the sampler samples.

Step parts (--step-parts): on the offline engine, in process and on the service in alternating rounds of
`--output-len` tokens at each number of rows, the median ms of each of a decode step's parts (STEP_PARTS: the
forward pass, the logits, the sampling call and within it the greedy step's send (with the slot write) and the wait
for its answer, and the next step's work done meanwhile). Run it with GOMP_SPINCOUNT=100000 in the environment to time the engine as `llmmesh
engine` runs it.

Serve (--serve-concurrency): two meshes as `llmmesh serve --no-kv-store` starts them, one with the sampler
service and one with --no-sampler-service, both up at once; at each concurrency, `rounds` rounds alternate which
goes first, each sending the same synthetic requests (32 prompt tokens, `--output-len` output tokens, greedy,
ignore_eos; as many requests as the concurrency, at least 4) through the gateway all at once (benchmarks/serve.py's
client); output tokens/s of each and the ratio per round, and per pair of rounds (each mesh first once: the
geometric mean of the two ratios, as the mesh that goes first in a round does worse). --serve-control: both meshes without the service (still
labelled as above), to see what the comparison gives between two alike.
"""

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.request import Request
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler
from mesh.sampler.remote import RemoteSampler
from mesh.sampler.wire import serialize_with_tensors
from mesh.tls import default_tls_dir
from services.certs import make_credentials
from services.local_mesh import Mesh
from services.service_process import ServiceProcess

FIRST_REGULAR_ID = 17


SAMPLING = {
    # The cheapest sampling: the hop's cost shows most.
    "greedy": lambda i: dict(temperature=0.0),
    # A common chat setting: the top-p sort costs both sides the same.
    "typical": lambda i: dict(temperature=0.7, top_p=0.95, seed=i),
}
sampling = "greedy"


def params(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **SAMPLING[sampling](i))


def run_round(llm, prompts, output_len) -> tuple[float, list]:
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [params(i, output_len) for i in range(len(prompts))], use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def throughput(llm, address, streams_list, rounds, output_len, seed) -> list[dict]:
    runner = llm.engine.worker.model_runner
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    client = RemoteSampler(address, slot_bytes=max(streams_list) * vocab * 4)  # shared memory, as the engine has it
    local_sampler = runner.sampler
    results = []
    try:
        for streams in streams_list:
            prompts = [[rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(32)] for _ in range(streams)]
            for mode in (local_sampler, client):  # warm-up: the whole batch once each way (the first run allocates)
                runner.sampler = mode
                run_round(llm, prompts, 4)
            local, remote, ratios = [], [], []
            for r in range(rounds):
                order = ("local", "remote") if r % 2 == 0 else ("remote", "local")
                got = {}
                for mode in order:
                    runner.sampler = client if mode == "remote" else local_sampler
                    got[mode] = run_round(llm, prompts, output_len)
                runner.sampler = local_sampler
                assert got["local"][1] == got["remote"][1], "remote sampling gave other tokens"
                local.append(got["local"][0])
                remote.append(got["remote"][0])
                ratios.append(got["remote"][0] / got["local"][0])
                print(
                    f"streams {streams:4d} round {r + 1}: in-process {local[-1]:7.1f} tok/s, "
                    f"sampler service {remote[-1]:7.1f} tok/s, ratio {ratios[-1]:.3f}",
                    flush=True,
                )
            results.append(
                {
                    "streams": streams,
                    "in_process_tok_s": local,
                    "remote_tok_s": remote,
                    "ratios": ratios,
                    "median_ratio": statistics.median(ratios),
                }
            )
    finally:
        runner.sampler = local_sampler
        client.close()
    return results


def hop_batch(batch: int, vocab: int, rng: torch.Generator):
    requests = []
    for row in range(batch):
        request = Request(str(row), torch.randint(vocab, (32,), generator=rng).tolist(), params(row, 1000), (0,))
        for token in torch.randint(vocab, (16,), generator=rng).tolist():
            request.append_output_token_ids(token)
        requests.append(request)
    return requests, torch.randn(batch, vocab, generator=rng)


def hop(addresses: dict[str, str], batches, iters, vocab, warmup: int = 3) -> list[dict]:
    """Each iteration times every form once, in turn (the order rotating), so a busy machine's drift hits all
    of them alike; medians over the iterations after warm-up."""
    rng = torch.Generator().manual_seed(0)
    sampler = Sampler()
    results = []
    # name -> (address, rows of slots, step channel): the logits as bytes (over TCP, over a Unix socket) or in
    # shared memory, the messages over the step channel or over the stream.
    forms = {
        "tcp": (addresses["tcp"], 0, False),
        "uds": (addresses["uds"], 0, False),
        "shm": (addresses["tcp"], max(batches), True),
        "shm_stream": (addresses["tcp"], max(batches), False),
    }
    for batch in batches:
        requests, logits = hop_batch(batch, vocab, rng)
        generators = {row: torch.Generator().manual_seed(row) for row in range(batch)}

        def local():
            md = SamplingMetadata.from_requests(requests, generators, vocab, torch.device("cpu"))
            sampler(logits.clone(), md)

        row = {"batch": batch, "logits_bytes": logits.numel() * 4}
        clients = {
            name: RemoteSampler(address, slot_bytes=rows * vocab * 4, step_channel=channel)
            for name, (address, rows, channel) in forms.items()
        }
        try:
            calls = {"in_process": local}
            for name, client in clients.items():
                client.sample(requests, logits, [])  # registers the requests: later steps carry no parameters
                assert (client.slots is not None) == name.startswith("shm"), f"{name}: not the form it names"
                assert (client.step_channel is not None) == (name == "shm"), f"{name}: not the channel it names"
                calls[name] = lambda client=client: client.sample(requests, logits, [])
                msg, _ = client._prompt_message([], None)
                client._add_rows(msg, requests)
                if name.startswith("shm"):
                    client._write_slot(msg, logits)
                    row["shm_message_bytes"] = len(msg.SerializeToString())
                else:
                    row["message_bytes"] = len(serialize_with_tensors(msg, {"logits": logits}))
            times = {name: [] for name in calls}
            names = list(calls)
            for i in range(warmup + iters):
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    start = time.perf_counter()
                    calls[name]()
                    if i >= warmup:
                        times[name].append((time.perf_counter() - start) * 1e3)
            row.update({f"{name}_ms": statistics.median(t) for name, t in times.items()})
        finally:
            for client in clients.values():
                client.close()
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def decode_step_ms(llm, batch: int, vocab: int) -> dict:
    """The engine's median step while `batch` requests decode (in-process sampling), and the medians of its
    scheduling, input-building (with async scheduling: writing the sampled tokens into the batch prepared ahead)
    and output-update parts, and of the work for the next step that async scheduling moves into the sampler's
    time (schedule_ahead: its blocks; prepare_ahead: its inputs)."""
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(16)]} for _ in range(batch)]
    core, runner, times, parts = llm.engine, llm.engine.worker.model_runner, [], []
    step, prepare_inputs, schedule_ahead = core.step, runner.prepare_inputs, core.scheduler.schedule_ahead
    prepare_ahead = runner.prepare_ahead
    prepared, ahead, inputs_ahead = [], [], []

    def timed_prepare(so):
        start = time.perf_counter()
        out = prepare_inputs(so)
        prepared.append((time.perf_counter() - start) * 1e3)
        return out

    def timed_ahead(so):
        start = time.perf_counter()
        next_step = schedule_ahead(so)
        ahead.append((time.perf_counter() - start) * 1e3)
        return next_step

    def timed_prepare_ahead(so, next_step):
        start = time.perf_counter()
        prepare_ahead(so, next_step)
        inputs_ahead.append((time.perf_counter() - start) * 1e3)

    def timed_step():
        start = time.perf_counter()
        out = step()
        if all(r.num_output_tokens > 0 for r in core.scheduler.running) and len(core.scheduler.running) == batch:
            times.append((time.perf_counter() - start) * 1e3)
            last = core.last_step
            parts.append((last.schedule_s * 1e3, prepared[-1], last.update_s * 1e3, ahead[-1], inputs_ahead[-1]))
        return out

    core.step, runner.prepare_inputs, core.scheduler.schedule_ahead = timed_step, timed_prepare, timed_ahead
    runner.prepare_ahead = timed_prepare_ahead
    try:
        llm.generate(prompts, [params(i, 12) for i in range(batch)], use_tqdm=False)
    finally:
        del core.step, runner.prepare_inputs, core.scheduler.schedule_ahead, runner.prepare_ahead
    if not times:
        return {"decode_step_ms": float("nan")}
    return {
        "decode_step_ms": statistics.median(times),
        **{
            f"{name}_ms": statistics.median(p[i] for p in parts)
            for i, name in enumerate(("schedule", "prepare", "update", "schedule_ahead", "prepare_ahead"))
        },
    }


STEP_PARTS = {  # part -> (what it is called on, method): timed around each call
    "forward": ("model", "forward"),
    "logits": ("model", "compute_logits"),
    "sample": ("sampler", "sample"),
    "ahead": ("runner", "_while_waiting"),
    # A greedy step's: the logits into their slot and the step sent; the wait for its answer.
    "send": ("kernels", "send_greedy_step"),
    "recv": ("kernels", "recv_greedy_answer"),
}


def step_parts(llm, address, rows_list, rounds, output_len, seed) -> list[dict]:
    """Where a decode step's time goes, sampling in process against on the service (shared memory, the step
    socket), alternating rounds on one engine: the median ms of each STEP_PARTS call over a round's steps (the
    first 4 left out), the median over rounds, and each round's tok/s ratio."""
    runner = llm.engine.worker.model_runner
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(seed)
    client = RemoteSampler(address, slot_bytes=max(rows_list) * vocab * 4)
    local_sampler, calls, results = runner.sampler, {}, []

    def timed(part, obj):
        method = getattr(obj, STEP_PARTS[part][1])

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                calls.setdefault(part, []).append((time.perf_counter() - start) * 1e3)

        setattr(obj, STEP_PARTS[part][1], wrapper)

    try:
        for mode in (local_sampler, client):  # warm-up; the service's first step opens its slots and socket
            runner.sampler = mode
            run_round(llm, [[FIRST_REGULAR_ID] * 32], 4)
        owners = {"model": runner.model, "runner": runner, "kernels": client._greedy_views[0], "sampler": None}
        for part, (owner, _) in STEP_PARTS.items():
            for obj in (local_sampler, client) if owner == "sampler" else (owners[owner],):
                timed(part, obj)
        for rows in rows_list:
            prompts = [[rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(32)] for _ in range(rows)]
            row = {"rows": rows, "in_process": {}, "sampler_service": {}, "ratios": []}
            for r in range(rounds):
                tok_s = {}
                for mode in ("in_process", "sampler_service")[:: 1 if r % 2 == 0 else -1]:
                    runner.sampler = client if mode == "sampler_service" else local_sampler
                    calls.clear()
                    tok_s[mode] = run_round(llm, prompts, output_len)[0]
                    for part, ms in calls.items():
                        row[mode].setdefault(part, []).append(statistics.median(ms[4:] or ms))
                row["ratios"].append(tok_s["sampler_service"] / tok_s["in_process"])
            for mode in ("in_process", "sampler_service"):
                row[mode] = {part: statistics.median(ms) for part, ms in row[mode].items()}
            row["median_ratio"] = statistics.median(row["ratios"])
            print(
                f"rows {rows}: "
                + ", ".join(
                    f"{part} {row['in_process'].get(part, float('nan')):.3f} / {row['sampler_service'].get(part, float('nan')):.3f}"
                    for part in STEP_PARTS
                )
                + f" ms (in process / service); ratios {', '.join(f'{x:.3f}' for x in row['ratios'])}",
                flush=True,
            )
            results.append(row)
    finally:
        runner.sampler = local_sampler
        client.close()
    return results


def serve_throughput(concurrencies, rounds, output_len, seed, control=False) -> list[dict]:
    """`llmmesh serve --no-kv-store` with the sampler service against --no-sampler-service (both meshes up at
    once), alternating which goes first each round. control: both meshes without the service (the first made
    stands in for the service's), for the comparison's own spread."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import asyncio

    from serve import run_mesh, synthetic_requests

    from engine.models.loader import prepare_model_dir
    from engine.text.tokenizer import Tokenizer

    args = EngineArgs(kv_cache_memory="1GiB")
    tokenizer = Tokenizer.from_pretrained(prepare_model_dir(args.model))
    results = []
    with Mesh(args, sampler=not control) as with_sampler, Mesh(args, sampler=False) as without:
        meshes = {"sampler service": with_sampler.address, "in process": without.address}
        for concurrency in concurrencies:
            requests = synthetic_requests(tokenizer, max(4, concurrency), (32, 32), (output_len, output_len), seed)
            warmup = synthetic_requests(tokenizer, max(4, concurrency), (32, 32), (4, 4), seed)
            for address in meshes.values():  # warm-up: the whole batch once each (the first run allocates)
                asyncio.run(run_mesh(address, warmup, float("inf"), 1.0, concurrency, seed, "", None))
            row = {"concurrency": concurrency, "in_process_tok_s": [], "sampler_service_tok_s": [], "ratios": []}
            for r in range(rounds):
                got = {}
                for name in list(meshes)[:: 1 if r % 2 == 0 else -1]:
                    out, elapsed = asyncio.run(
                        run_mesh(meshes[name], requests, float("inf"), 1.0, concurrency, seed, "", None)
                    )
                    assert all(x.ok for x in out), [x.error for x in out if not x.ok][:3]
                    got[name] = sum(x.output_tokens for x in out) / elapsed
                row["in_process_tok_s"].append(got["in process"])
                row["sampler_service_tok_s"].append(got["sampler service"])
                row["ratios"].append(got["sampler service"] / got["in process"])
                print(
                    f"concurrency {concurrency:4d} round {r + 1}: in process {got['in process']:7.1f} tok/s, "
                    f"sampler service {got['sampler service']:7.1f} tok/s, ratio {row['ratios'][-1]:.3f}",
                    flush=True,
                )
            row["median_ratio"] = statistics.median(row["ratios"])
            # Whichever mesh goes first in a round does worse; a pair of rounds has each go first once, and its
            # ratio (the geometric mean of the two) leaves the order out.
            pairs = zip(row["ratios"][0::2], row["ratios"][1::2])
            row["pair_ratios"] = [math.sqrt(a * b) for a, b in pairs]
            if row["pair_ratios"]:
                row["median_pair_ratio"] = statistics.median(row["pair_ratios"])
                print(
                    f"concurrency {concurrency:4d}: median of the rounds' ratios {row['median_ratio']:.3f}; of the "
                    f"pairs' (each mesh first once) {row['median_pair_ratio']:.3f}; the service first "
                    f"{statistics.median(row['ratios'][0::2]):.3f}, second {statistics.median(row['ratios'][1::2]):.3f}",
                    flush=True,
                )
            results.append(row)
    return results


def serve_both(tcp_port_file: str, uds: str) -> None:
    """--serve-both: the sampler service on TCP loopback and a Unix domain socket (for the hop benchmark)."""
    import asyncio

    import grpc

    from llmmesh.v1 import sampler_pb2_grpc
    from mesh import tls
    from mesh.grpc_policy import MAX_MESSAGE_BYTES, SERVER_OPTIONS
    from services.sampler_service import SamplerServicer

    async def main():
        server = grpc.aio.server(
            options=SERVER_OPTIONS
            + [
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        sampler_pb2_grpc.add_SamplerServicer_to_server(SamplerServicer(torch.device("cpu")), server)
        # Mutual TLS as `llmmesh sampler` serves it (plaintext under LLMMESH_INSECURE_PLAINTEXT, as RemoteSampler's).
        own = tls.credentials_from_env("sampler")

        def listen(where: str) -> int:
            if own is None:
                return server.add_insecure_port(where)
            return server.add_secure_port(where, own.server_credentials())

        port = listen("127.0.0.1:0")
        listen(f"unix:{uds}")
        await server.start()
        with open(tcp_port_file, "w") as f:
            f.write(str(port))
        await server.wait_for_termination()

    asyncio.run(main())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,32,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hop-batches", default="1,64,256")
    ap.add_argument("--hop-iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-hop", action="store_true")
    ap.add_argument("--serve-concurrency", default="", help="e.g. 1,32,64,256: the mesh with and without the service")
    ap.add_argument(
        "--serve-control", action="store_true", help="both meshes without the service: what the comparison gives alike"
    )
    ap.add_argument("--step-parts", default="", help="e.g. 1,32,64,256: a decode step's parts at these rows")
    ap.add_argument("--output-json", default="benchmarks/results/sampler_service.json")
    ap.add_argument("--serve-both", nargs=2, metavar=("PORT_FILE", "UDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_both:
        return serve_both(*args.serve_both)
    make_credentials(default_tls_dir())  # the mesh's, as `llmmesh serve` makes them on first start
    global sampling
    sampling = args.sampling

    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{'CUDA' if torch.cuda.is_available() else 'no GPU'}",
        "args": vars(args),
    }
    if args.serve_concurrency:
        concurrencies = [int(c) for c in args.serve_concurrency.split(",")]
        report["serve"] = serve_throughput(concurrencies, args.rounds, args.output_len, args.seed, args.serve_control)
    if args.skip_throughput and args.skip_hop and not args.step_parts:
        return write_report(args.output_json, report)
    llm = LLM(kv_cache_memory="2GiB", max_num_seqs=256, seed=args.seed)
    vocab = llm.engine.model_config.vocab_size
    if not args.skip_throughput or args.step_parts:
        sampler = ServiceProcess("sampler", ["--port", "0"])
        try:
            address = sampler.wait_listening(120)
            if not args.skip_throughput:
                report["throughput"] = throughput(
                    llm, address, [int(s) for s in args.streams.split(",")], args.rounds, args.output_len, args.seed
                )
            if args.step_parts:
                rows = [int(r) for r in args.step_parts.split(",")]
                report["step_parts"] = step_parts(llm, address, rows, args.rounds, args.output_len, args.seed)
        finally:
            sampler.stop()
    if not args.skip_hop:
        workdir = tempfile.mkdtemp(prefix="llmmesh-sampler-bench-")
        port_file, uds = os.path.join(workdir, "port"), os.path.join(workdir, "sampler.sock")
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve-both", port_file, uds],
            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},  # as `llmmesh sampler` runs
        )
        try:
            while not os.path.exists(port_file) or not open(port_file).read():
                if server.poll() is not None:
                    raise RuntimeError("the sampler for the hop benchmark exited")
                time.sleep(0.1)
            addresses = {"tcp": f"127.0.0.1:{open(port_file).read()}", "uds": f"unix:{uds}"}
            report["hop"] = hop(addresses, [int(b) for b in args.hop_batches.split(",")], args.hop_iters, vocab)
        finally:
            server.terminate()
            server.wait()
        for row in report["hop"]:
            row.update(decode_step_ms(llm, row["batch"], vocab))
            print(f"batch {row['batch']}: decode step {row['decode_step_ms']:.1f} ms", flush=True)
    write_report(args.output_json, report)


def write_report(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
