"""docs/benchmarks.md's figures, written from the results under docs/benchmarks/: one JSON file a benchmark in
docs/benchmarks/results/ and the machines in docs/benchmarks/machines.json. The summary table, the machines and
each benchmark's section lie in the page between `<!-- generated: NAME -->` and `<!-- end generated -->` (the
markers of services/docs_sections.py, which writes them); the prose around them is the page's own.
benchmarks/plots.py draws the figures from the same files, so a table and its plot cannot disagree; tests/test_docs.py
fails when the page or a plot is older than its data. It needs no matplotlib: the project's venv runs it.

    .venv/bin/python benchmarks/report.py      # rewrite docs/benchmarks.md's generated sections (also `make docs`)

A result file holds (every figure a string, as written where it was measured):

    section    the heading it goes under (results with the same section share it)
    measures   what it measures, in a sentence or three
    command    the command that reproduces it (null where no script does)
    machine    a key of machines.json (null where the figure is the same on any machine)
    headline   {"what", "ours", "peer", "ratio"}: its row in the summary table ("" where there is no peer)
    tables     [{"name", "caption"?, "columns", "rows"}], drawn as they are
    plots      [{"file", "alt"}]: figures that benchmarks/plots.py draws from the tables, under docs/benchmarks/
    inputs     other files under docs/benchmarks/ a plot reads (a benchmark's raw report)
    notes      what the figure means
"""

import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.docs_sections import replace_sections  # noqa: E402 (the repository's root is on the path only now)

DOC = ROOT / "docs" / "benchmarks.md"
TABLES = ROOT / "docs" / "benchmarks" / "tables.md"
DATA = ROOT / "docs" / "benchmarks"
RESULTS = DATA / "results"
COMMAND = "python benchmarks/report.py"

# The order of the sections; a result not named here follows them, by name.
ORDER = [
    "offline-throughput",
    "vllm-cpu",
    "mesh-vs-offline",
    "mesh-overhead",
    "ttft-burst",
    "sampler-service",
    "sampler",
    "structured-output",
    "kv-store",
    "kv-store-mesh",
    "kv-store-fp8",
    "routing",
    "migration",
    "pd",
    "latency-llama-cpp",
    "dense-linear-bf16",
    "dense-linear-f32",
    "dense-linear-f32-avx2",
    "batch-invariance",
    "batch-invariance-avx2",
    "attention",
    "attention-avx2",
    "host-time",
    "step-split",
    "spec-decode",
    "lora",
    "tensor-parallel",
    "tp-determinism",
    "pipeline-parallel",
    "moe",
    "expert-parallel",
    "hybrid-kv",
    "vision",
    "mla-kv-bytes",
    "tls-cost",
    "tracing",
    "detokenizer",
    "model-load",
    "gguf-load",
    "k8s-sizing",
    "test-suite",
]
# The PNG text key under which a plot keeps the digest of what it was drawn from.
DIGEST_KEY = "llmmesh-data-sha256"


def results() -> dict[str, dict]:
    """name -> result, in the page's order."""
    found = {path.stem: json.loads(path.read_text()) for path in RESULTS.glob("*.json")}
    names = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
    return {name: found[name] for name in names}


def machines() -> dict[str, dict]:
    return json.loads((DATA / "machines.json").read_text())


def plot_digest(result: dict) -> str:
    """What a result's plots are drawn from: its tables and the bytes of its other inputs."""
    inputs = {name: hashlib.sha256((DATA / name).read_bytes()).hexdigest() for name in result.get("inputs", [])}
    text = json.dumps({"tables": result.get("tables", []), "inputs": inputs}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        assert len(row) == len(columns), (columns, row)
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


def machine_link(key: str | None) -> str:
    if key is None:
        return "any"
    return f"[{machines()[key]['name']}](#machines)"


def summary() -> str:
    rows = []
    for result in results().values():
        head = result["headline"]
        what = f"[{head['what']}](#{slug(result['section'])})"
        rows.append([what, head["ours"], head["peer"] or "–", head["ratio"] or "–", machine_link(result["machine"])])
    return "\n".join(table(["what", "ours", "peer, same run", "ratio", "machine"], rows))


def machine_list() -> str:
    return "\n".join(f"- **{m['name']}:** {m['description']}" for m in machines().values())


def section(result: dict) -> str:
    """One result's part of its section: what it measures, how to run it and what it means, where its tables are,
    then its plots."""
    run = f"`{result['command']}`" if result["command"] else "no script"
    text = f"{result['measures']} Run: {run}; machine: {machine_link(result['machine'])}."
    if result.get("notes"):
        text += f" {result['notes']}"
    if result.get("tables"):
        text += f" Every figure: [its tables](benchmarks/tables.md#{slug(result['section'])})."
    lines = [text, ""]
    if result.get("plots"):
        lines += [" ".join(f"![{p['alt']}](benchmarks/{p['file']})" for p in result["plots"]), ""]
    return "\n".join(lines).rstrip("\n")


def by_section(render_one) -> list[str]:
    """Every result rendered under its section's heading (results sharing a section share one heading)."""
    out, heading = [], None
    for result in results().values():
        text = render_one(result)
        if not text:
            continue
        if result["section"] != heading:
            heading = result["section"]
            out += [f"## {heading}", ""]
        out += [text, ""]
    return out


def sections() -> str:
    return "\n".join(by_section(section)).rstrip("\n")


def result_tables(result: dict) -> str:
    lines = []
    for t in result.get("tables", []):
        if t.get("caption"):
            lines += [t["caption"], ""]
        lines += [*table(t["columns"], t["rows"]), ""]
    return "\n".join(lines).rstrip("\n")


def tables_page() -> str:
    """docs/benchmarks/tables.md, written whole: every result's tables, under the headings of docs/benchmarks.md."""
    head = [
        "# Benchmark tables",
        "",
        f"Every figure behind [the benchmark report](../benchmarks.md), by benchmark; written by `{COMMAND}` from",
        "the results in `docs/benchmarks/results/`, never by hand.",
        "",
    ]
    return "\n".join(head + by_section(result_tables)).rstrip("\n") + "\n"


GENERATED = {"summary": summary, "machines": machine_list, "results": sections}


def render(text: str) -> str:
    """The page with each of its generated sections written afresh."""
    return replace_sections("benchmarks.md", text, GENERATED)


def main() -> None:
    DOC.write_text(render(DOC.read_text()))
    TABLES.write_text(tables_page())
    print(f"wrote the generated sections of {DOC}, and {TABLES}", file=sys.stderr)


if __name__ == "__main__":
    main()
