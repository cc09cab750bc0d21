"""The figures of docs/benchmarks.md, drawn from the tables of the results in docs/benchmarks/results/ (and, for
the TTFT distribution, the per-request latencies a `benchmarks/serve.py` run kept in docs/benchmarks/serve-ttft.json);
no numbers of their own. benchmarks/report.py writes the page's tables from the same files.

    build/docs/bin/python benchmarks/plots.py     # `make docs` makes build/docs, a venv with matplotlib

Each PNG keeps, in a text chunk, the digest of what it was drawn from (report.plot_digest), so tests/test_docs.py
fails when a result's tables changed and its plot was not drawn again. A figure reads its columns by name: a table
that changed shape fails loudly here rather than drawing something else.
"""

import json
import re
import sys
from pathlib import Path

import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

OUT = report.DATA


def rows(result: dict, name: str) -> list[dict[str, str]]:
    """The rows of one of a result's tables, as dicts by column name."""
    table = next(t for t in result["tables"] if t["name"] == name)
    return [dict(zip(table["columns"], row)) for row in table["rows"]]


def numbers(cell: str) -> list[float]:
    """The numbers in a cell ("60.7 (59.7, 60.7, 61.0)", "1.71×", "1,415")."""
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\.?\d*", cell)]


def first(cell: str) -> float:
    return numbers(cell)[0]


def save(fig, name: str, result: dict) -> None:
    fig.tight_layout()
    fig.savefig(OUT / name, dpi=110, metadata={report.DIGEST_KEY: report.plot_digest(result)})
    plt.close(fig)
    print(f"wrote docs/benchmarks/{name}")


def line_chart(ax, x: list[float], series: dict[str, list[float]], log: bool = False) -> None:
    """One line per series over x (log scales for quantities that span decades)."""
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def bars(ax, labels: list[str], groups: dict[str, list[float | None]]) -> None:
    """Grouped horizontal bars, one group a label (None: not measured), each value written at its bar's end."""
    height = 0.8 / len(groups)
    for i, (name, values) in enumerate(groups.items()):
        kept = [(y + i * height, v) for y, v in enumerate(values) if v is not None]
        ax.barh([y for y, _ in kept], [v for _, v in kept], height=height, label=name)
        for y, v in kept:
            ax.text(v, y, f" {v:g}", va="center", fontsize=7)
    ax.set_yticks([y + height * (len(groups) - 1) / 2 for y in range(len(labels))], labels)
    ax.invert_yaxis()
    if len(groups) > 1:
        ax.legend(fontsize=8)


def offline_throughput(result: dict) -> None:
    table = rows(result, "systems")
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    bars(ax, [r["system"].replace("`", "") for r in table], {"out tok/s": [first(r["out tok/s"]) for r in table]})
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.set_title("make bench: offline throughput, SmolLM2-135M float32")
    ax.set_xlim(0, max(first(r["out tok/s"]) for r in table) * 1.2)
    save(fig, "offline-throughput.png", result)


def lines_over(
    result: dict, table: str, x: str, series: dict[str, str], labels: dict, name: str, log=False, log_x=False
) -> None:
    """A figure of one line per column (label -> column) of a result's table over its column x; log scales both
    axes, log_x the x axis alone."""
    table_rows = rows(result, table)
    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    if log_x:
        ax.set_xscale("log", base=2)
    line_chart(
        ax,
        [first(r[x]) for r in table_rows],
        {label: [first(r[column]) for r in table_rows] for label, column in series.items()},
        log=log,
    )
    ax.set(**labels)
    save(fig, name, result)


def sampler_service(result: dict) -> None:
    lines_over(
        result,
        "serve",
        "concurrency",
        {
            "sampling in the engine": "in process tok/s (median)",
            "sampler service (shared memory)": "with the service tok/s (median)",
        },
        dict(
            xlabel="concurrent requests",
            ylabel="output tokens/s (median of rounds)",
            title="Throughput against concurrency through llmmesh serve",
            ylim=(0, None),
        ),
        "throughput-vs-concurrency.png",
        log_x=True,
    )
    lines_over(
        result,
        "hop",
        "batch",
        {
            "the whole decode step": "decode step (ms)",
            "sampler service, logits as bytes over TCP": "over TCP loopback (ms)",
            "sampler service, logits in shared memory": "shared memory, greedy step (ms)",
            "sampling in the engine": "in-process sample (ms)",
        },
        dict(
            xlabel="requests in the step", ylabel="ms a step", title="Sampling a step: in process against the service"
        ),
        "sampler-hop.png",
        log=True,
    )


def kv_store(result: dict) -> None:
    table = rows(result, "ttft")
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for dtype, style in (("float32", "-"), ("bfloat16", "--")):
        mine = [r for r in table if r["dtype"] == dtype]
        tokens = [first(r["prefix tokens"]) for r in mine]
        for column, label, color in (
            ("cold (s)", "recompute", "#d62728"),
            ("reload (s)", "reload from the store", "#1f77b4"),
            ("local hit (s)", "local prefix-cache hit", "#2ca02c"),
        ):
            # The longest prompt lists both of its rounds; the faster one (less disturbed by other work) is drawn.
            values = [min(numbers(r[column])) for r in mine]
            ax.plot(tokens, values, style, marker="o", color=color, label=f"{label} ({dtype})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [f"{t:,.0f}" for t in tokens])
    ax.set_yscale("log")
    ax.set(xlabel="prefix tokens", ylabel="time to first token (s)")
    ax.set_title("KV store: time to first token against context")
    ax.legend(fontsize=7)
    save(fig, "kv-store-ttft.png", result)

    lines_over(
        result,
        "multi-turn",
        "turn",
        {"with the KV store": "median TTFT with the store (s)", "without": "without (s)"},
        dict(
            xlabel="conversation turn",
            ylabel="median time to first token (s)",
            title="Multi-turn through the mesh (evicting working set)",
        ),
        "multi-turn-ttft.png",
    )


def cdf(ax, values: list[float]) -> None:
    """The share of values at or below each value."""
    values = sorted(values)
    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def ttft_burst(result: dict) -> None:
    """TTFT and ITL of every request of a serve.py run, as distributions (the run's report, not a table)."""
    raw = json.loads((OUT / result["inputs"][0]).read_text())
    run, args = raw["rounds"][0]["mesh"]["requests"], raw["args"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.4, 3.4))
    cdf(left, [r["ttft_ms"] / 1e3 for r in run])
    left.set(xlabel="time to first token (s)", ylabel="share of requests")
    cdf(right, [itl for r in run for itl in r["itl_ms"]])
    right.set(xlabel="inter-token latency (ms, log scale)", ylabel="share of token gaps", xscale="log")
    fig.suptitle(
        f"Through the mesh: {len(run)} requests, at most {args['max_concurrency']} in flight (shared cores: the shape only)",
        fontsize=10,
    )
    save(fig, "ttft-distribution.png", result)


def latency_against_llama_cpp(result: dict) -> None:
    table = rows(result, "decode")
    fig, axes = plt.subplots(1, 2, figsize=(8.8, 3.4))
    for ax, phase in zip(axes, ("decode", "prefill")):
        for engine in ("llama.cpp", "llmmesh GGUF bfloat16"):
            for threads in sorted({r["threads"] for r in table}):
                mine = [r for r in table if r["threads"] == threads]
                x = [first(r["parallel sequences"]) for r in mine]
                y = [first(r[f"{engine} {phase} tok/s"]) for r in mine]
                ax.plot(x, y, marker="o", label=f"{engine}, {threads} thread{'s' if threads != '1' else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.set(xlabel="parallel sequences (batch size)", ylabel=f"{phase} tokens/s", title=phase)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M Q4_1 GGUF against llama.cpp, 256-token prompts, 128 output tokens", fontsize=10)
    save(fig, "latency-vs-llama-cpp.png", result)


def routing(result: dict) -> None:
    table = rows(result, "policies")
    runs = list(dict.fromkeys(r["run"] for r in table))
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    bars(
        ax,
        runs,
        {
            workload: [
                first(next(r for r in table if r["workload"] == workload and r["run"] == run)["TTFT p50 (ms)"])
                for run in runs
            ]
            for workload in dict.fromkeys(r["workload"] for r in table)
        },
    )
    ax.set_xlabel("time to first token p50 (ms, lower is better)")
    ax.set_title("Routing multi-turn conversations across 2 engines")
    save(fig, "routing-ttft.png", result)


def lora(result: dict) -> None:
    table = rows(result, "systems")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    bars(
        ax,
        [r["system"] for r in table],
        {dtype: [first(r[f"{dtype} × base"]) for r in table] for dtype in ("bfloat16", "float32")},
    )
    ax.axvline(1.0, color="#999999", linewidth=0.8)
    ax.set_xlabel("output tokens/s as a share of the base model's")
    ax.set_title("LoRA adapters against the base model (lora-N-rR: N of rank R)", fontsize=10)
    ax.set_xlim(0, 1.2)
    save(fig, "lora-vs-base.png", result)


def spec_decode(result: dict) -> None:
    table = [r for r in rows(result, "workloads") if r["engine"] != "none"]
    labels = list(dict.fromkeys(f"{r['workload']}, concurrency {r['concurrency']}" for r in table))
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    groups = {}
    for engine in dict.fromkeys(r["engine"] for r in table):
        by_label = {
            f"{r['workload']}, concurrency {r['concurrency']}": first(r["vs none"])
            for r in table
            if r["engine"] == engine
        }
        groups[engine] = [by_label.get(label) for label in labels]
    bars(ax, labels, groups)
    ax.axvline(1.0, color="#999999", linewidth=0.8)
    ax.set_xlabel("decode tokens/s against no speculation (K = 3)")
    ax.set_title("Speculative decoding by workload")
    save(fig, "spec-decode.png", result)


FIGURES = {
    "offline-throughput": offline_throughput,
    "sampler-service": sampler_service,
    "kv-store": kv_store,
    "ttft-burst": ttft_burst,
    "latency-llama-cpp": latency_against_llama_cpp,
    "routing": routing,
    "lora": lora,
    "spec-decode": spec_decode,
}


def main() -> None:
    found = report.results()
    for name, figure in FIGURES.items():
        figure(found[name])
    drawn = {p["file"] for name in FIGURES for p in found[name].get("plots", [])}
    wanted = {p["file"] for result in found.values() for p in result.get("plots", [])}
    if wanted - drawn:
        raise SystemExit(f"no figure in benchmarks/plots.py draws {sorted(wanted - drawn)}")


if __name__ == "__main__":
    main()
