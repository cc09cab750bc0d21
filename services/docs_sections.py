"""The sections of the docs that the code defines, written from it: the request limits (engine/limits.py), the
metrics (the services' Prometheus registries) and `llmmesh serve`'s restart policy (services/supervisor.py). Each
lies in its page between `<!-- generated: NAME -->` and `<!-- end generated -->`; tests/test_docs.py fails when
one differs from what this writes.

    .venv/bin/python -m services.docs_sections      # rewrite them (also `make docs`)
"""

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

from engine.limits import RequestLimits

DOCS = Path(__file__).resolve().parent.parent / "docs"
COMMAND = "python -m services.docs_sections"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def request_limits() -> str:
    rows = ["| flag | default | what it caps |", "| --- | --- | --- |"]
    for f in dataclasses.fields(RequestLimits):
        rows.append(f"| `--{f.name.replace('_', '-')}` | {f.default} | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(rows)


def restart_policy() -> str:
    from services import supervisor

    return (
        f"A service that dies is started again on the same port (its `/metrics` port too), after "
        f"{supervisor.RESTART_BACKOFF_S:g} s, doubled for each time it was restarted in the last "
        f"{supervisor.RESTART_WINDOW_S:g} s; the others reconnect to it by themselves, and requests that needed it\n"
        f"in the meantime fail with `UNAVAILABLE`. Redis comes back empty (it is a cache). A service that dies again "
        f"after {supervisor.MAX_RESTARTS} restarts within {supervisor.RESTART_WINDOW_S:g} s is in a crash loop: serve "
        "stops the mesh, says which service and why, and exits with code 1. `llmmesh serve` checks each service's gRPC "
        f"health every {supervisor.HEALTH_INTERVAL_S:g} s (a check fails unless answered within "
        f"{supervisor.HEALTH_TIMEOUT_S:g} s)."
    )


def _families(registry) -> dict[str, tuple[str, list[str], str]]:
    """name -> (type, labels, help) of what a registry exports, as Prometheus shows it (counters with _total)."""
    out = {}
    for family in registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels} - {"le", "quantile"})
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, labels, family.documentation)
    return out


def _engine_registry(lora=False, connector=False, spec=False, encoder=False):
    """An engine service's registry, with the stats of an engine that has the given parts on."""
    from engine.multimodal.encoder_cache import EncoderCacheStats
    from engine.sched.output import SchedulerStats
    from engine.spec_decode.metrics import SpecDecodingStats
    from services.engine_telemetry import KV_CONNECTOR_METRICS, EngineTelemetry
    from services.telemetry import Telemetry

    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, 1)
    stats.kv_connector_stats = dict.fromkeys([*KV_CONNECTOR_METRICS, "<key>"], 0) if connector else None
    stats.spec_decoding_stats = SpecDecodingStats(1) if spec else None
    if encoder:
        stats.encoder_cache_usage, stats.encoder_cache_stats = 0.0, EncoderCacheStats()
    info = SimpleNamespace(
        block_size=16, num_blocks=1, enable_prefix_caching=True, prefix_caching_hash_algo="sha256", enable_lora=lora
    )
    info.max_loras = 1
    owner = SimpleNamespace(engine=SimpleNamespace(stats=stats, info=info, hook_errors=0, kv_event_drops=0))
    telemetry = Telemetry("engine", SimpleNamespace(metrics_port=0))
    EngineTelemetry(telemetry, owner, "m")
    return telemetry.registry


def metrics() -> str:
    from services import kvstore_service
    from services.metrics_server import DictCounters
    from services.telemetry import Telemetry

    base = _families(_engine_registry())
    every = _families(Telemetry("any", SimpleNamespace(metrics_port=0)).registry)
    groups = [("engine", {k: v for k, v in base.items() if k not in every})]
    for title, part in (
        ("engine, with `--enable-lora`", {"lora": True}),
        ("engine, with a KV connector", {"connector": True}),
        ("engine, with `--speculative-config`", {"spec": True}),
        ("engine, serving a vision-language model", {"encoder": True}),
    ):
        more = _families(_engine_registry(**part))
        groups.append((title, {k: v for k, v in more.items() if k not in base}))
    kvstore = DictCounters("llmmesh:kvstore_", dict.fromkeys(kvstore_service.COUNTERS, 0))
    groups.append(("kvstore", {f"{f.name}_total": (f.type, [], f.documentation) for f in kvstore.collect()}))
    groups.append(("every service", every))
    rows = ["| name | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for title, families in groups:
        rows.append(f"| **{title}** | | | |")
        for name, (kind, labels, doc) in families.items():
            labels_text = ", ".join(f"`{label}`" for label in labels)
            rows.append(f"| `{name}` | {kind} | {labels_text} | {_cell(doc)} |")
    return "\n".join(rows)


# page -> {section name -> its text}
SECTIONS = {
    "api.md": {"request-limits": request_limits},
    "deployment.md": {"restart-policy": restart_policy},
    "observability.md": {"metrics": metrics},
}


def replace_sections(page: str, text: str, sections: dict) -> str:
    """The page's text with each of the given sections (name -> a function writing it) written afresh."""
    for name, make in sections.items():
        begin, end = f"<!-- generated: {name} -->\n", "<!-- end generated -->"
        assert begin in text, f"docs/{page} has no `{begin.strip()}` section"
        head, rest = text.split(begin, 1)
        text = head + begin + make() + "\n" + end + rest.split(end, 1)[1]
    return text


def render(page: str, text: str) -> str:
    """The page's text with each of its generated sections written afresh."""
    return replace_sections(page, text, SECTIONS[page])


def main() -> None:
    for page in SECTIONS:
        path = DOCS / page
        path.write_text(render(page, path.read_text()))
        print(f"wrote the generated sections of {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
