"""The figures of docs/benchmarks.md, drawn from the tables in that file and from the per-request latencies a
`benchmarks/serve.py` run kept (its report, copied to docs/benchmarks/serve-ttft.json); no numbers of their own.

    build/docs/bin/python benchmarks/plots.py     # `make docs` makes build/docs, a venv with matplotlib

Each figure reads one table, found by its header row; a figure whose table changed shape fails loudly here
rather than drawing something else.
"""

import json
import re
import statistics
from pathlib import Path

import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
OUT = ROOT / "docs" / "benchmarks"


def table(text: str, header: str) -> list[dict[str, str]]:
    """The rows of the first table whose header row starts with `header`, as dicts by column name."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    if start is None:
        raise SystemExit(f"docs/benchmarks.md has no table whose header starts with {header!r}")
    names = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(names, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def numbers(cell: str, skip_bracketed: bool = True) -> list[float]:
    """The numbers in a cell ("16.1, (18.8), 14.9", "**28×**", "1,415"); bracketed ones are outliers the text
    explains, left out unless asked."""
    if skip_bracketed:
        cell = re.sub(r"\([^)]*\)", "", cell)
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\.?\d*", cell)]


def first(cell: str) -> float:
    return numbers(cell)[0]


def save(fig, name: str) -> None:
    fig.tight_layout()
    fig.savefig(OUT / name, dpi=110)
    plt.close(fig)
    print(f"wrote docs/benchmarks/{name}")


def offline_throughput(text: str) -> None:
    rows = table(text, "| system | wall s | req/s | out tok/s |")
    names = [re.sub(r"\*|`", "", r["system"]) for r in rows]
    values = [first(r["out tok/s"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    ax.barh(names[::-1], values[::-1], color=["#999999"] * (len(rows) - 1) + ["#1f77b4"])
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:g}", va="center")
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.set_title("make bench: offline throughput on 2 vCPUs")
    ax.set_xlim(0, max(values) * 1.2)
    save(fig, "offline-throughput.png")


def line_chart(
    name: str, title: str, x: list[float], xlabel: str, series: dict[str, list[float]], ylabel: str, log: bool = False
) -> None:
    """One line per series over x (log scales for quantities that span decades)."""
    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    save(fig, name)


def sampler_service_throughput(text: str) -> None:
    rows = sorted(table(text, "| streams | in-process tok/s (rounds) |"), key=lambda r: first(r["streams"]))
    line_chart(
        "throughput-vs-batch.png",
        "Throughput against batch size",
        [first(r["streams"]) for r in rows],
        "concurrent requests (batch size)",
        {
            label: [statistics.median(numbers(r[column])) for r in rows]
            for column, label in (
                ("in-process tok/s (rounds)", "sampling in the engine"),
                ("sampler service tok/s (rounds)", "sampler service (TCP loopback)"),
            )
        },
        "output tokens/s (median of rounds)",
    )


def sampler_hop(text: str) -> None:
    rows = table(text, "| batch | bytes per step | in-process sample (ms) |")
    line_chart(
        "sampler-hop.png",
        "Sampling per step: in process against the service",
        [first(r["batch"]) for r in rows],
        "requests in the step",
        {
            label: [first(r[column]) for r in rows]
            for column, label in (
                ("decode step (ms)", "the whole decode step"),
                ("over TCP loopback (ms)", "on the sampler service, logits as bytes"),
                ("in shared memory (ms)", "on the sampler service, logits in shared memory"),
                ("in-process sample (ms)", "sampling in the engine"),
            )
        },
        "ms per step",
        log=True,
    )


def kv_store_ttft(text: str) -> None:
    rows = table(text, "| dtype | prefix tokens | rounds | cold (s) |")
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for dtype, style in (("float32", "-"), ("bfloat16", "--")):
        mine = [r for r in rows if r["dtype"] == dtype]
        tokens = [first(r["prefix tokens"]) for r in mine]
        for column, label, color in (
            ("cold (s)", "recompute", "#d62728"),
            ("reload (s)", "reload from the store", "#1f77b4"),
            ("local hit (s)", "local prefix-cache hit", "#2ca02c"),
        ):
            # The longest prompt lists both rounds; the quieter (smaller) one is drawn.
            ax.plot(
                tokens,
                [min(numbers(r[column])) for r in mine],
                style,
                marker="o",
                color=color,
                label=f"{label} ({dtype})",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [f"{t:,.0f}" for t in tokens])
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("KV store: time to first token by prefix length")
    ax.legend(fontsize=7)
    save(fig, "kv-store-ttft.png")


def multi_turn(text: str) -> None:
    rows = table(text, "| turn | median TTFT with the store (s) |")
    line_chart(
        "multi-turn-ttft.png",
        "Multi-turn through the mesh (evicting working set)",
        [first(r["turn"]) for r in rows],
        "conversation turn",
        {
            "with the KV store": [first(r["median TTFT with the store (s)"]) for r in rows],
            "without": [first(r["without (s)"]) for r in rows],
        },
        "median time to first token (s)",
    )


def cdf(ax, values: list[float]) -> None:
    """The share of values at or below each value."""
    values = sorted(values)
    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def ttft_distribution(text: str) -> None:
    """TTFT and ITL of every request of a serve.py run, as distributions (the docs' tables give only percentiles)."""
    report = json.loads((OUT / "serve-ttft.json").read_text())
    run, args = report["rounds"][0]["mesh"]["requests"], report["args"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.4, 3.4))
    cdf(left, [r["ttft_ms"] / 1e3 for r in run])
    left.set(xlabel="time to first token (s)", ylabel="share of requests")
    cdf(right, [itl for r in run for itl in r["itl_ms"]])
    right.set(xlabel="inter-token latency (ms, log scale)", ylabel="share of token gaps", xscale="log")
    fig.suptitle(
        f"Through the mesh: {len(run)} requests, at most {args['max_concurrency']} in flight "
        f"({report['machine']}, {report['date'][:10]})",
        fontsize=10,
    )
    save(fig, "ttft-distribution.png")


def latency_against_llama_cpp(text: str) -> None:
    rows = table(text, "| parallel sequences | threads | llama.cpp decode tok/s |")
    fig, axes = plt.subplots(1, 2, figsize=(8.8, 3.4))
    for ax, phase in zip(axes, ("decode", "prefill")):
        for engine in ("llama.cpp", "llmmesh GGUF bfloat16"):
            for threads in sorted({r["threads"] for r in rows}):
                mine = [r for r in rows if r["threads"] == threads]
                x = [first(r["parallel sequences"]) for r in mine]
                y = [first(r[f"{engine} {phase} tok/s"]) for r in mine]
                ax.plot(x, y, marker="o", label=f"{engine}, {threads} thread{'s' if threads != '1' else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.set(xlabel="parallel sequences (batch size)", ylabel=f"{phase} tokens/s", title=phase)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M Q4_1 GGUF, 256-token prompts, 128 output tokens", fontsize=10)
    save(fig, "latency-vs-llama-cpp.png")


def main() -> None:
    text = DOC.read_text()
    OUT.mkdir(exist_ok=True)
    figures = (
        offline_throughput,
        sampler_service_throughput,
        sampler_hop,
        kv_store_ttft,
        multi_turn,
        ttft_distribution,
        latency_against_llama_cpp,
    )
    for figure in figures:
        figure(text)


if __name__ == "__main__":
    main()
