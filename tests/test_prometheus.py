"""A real Prometheus (Debian's `prometheus`, 2.x) scraping a real mesh, as a user's would: every series is stored
under the name the services document (vLLM's vllm:*, our llmmesh:*, gRPC's), and every expression of the Grafana
dashboard (docs/observability/grafana-dashboard.json), evaluated by that Prometheus, draws a panel that moves with a
workload of prefix-cache hits, a KV-store load, a corrupt stored block, a preemption and a stop-string finish."""

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from engine.config import EngineArgs
from services.certs import redis_password
from services.client import collect, generate
from services.local_mesh import Mesh
from services.prometheus import scrape_config
from services.service_process import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is not installed: `make setup` installs "
        "Debian's prometheus when run as root (apt-get install prometheus)",
    ),
]

DOCS = Path(__file__).parent.parent / "docs/observability"
SCRAPE_INTERVAL_S = 1
# Grafana's $__rate_interval for a data source scraped every second: four scrape intervals.
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S}s"
WAIT_S = 60.0  # a bound on waiting for Prometheus (the test waits for scrapes, it asserts no speed)
# A 12-block KV cache (16 tokens a block): long requests at once preempt each other, and 180 tokens evict the rest.
KV = "9MiB"
PROMPT = "The capital of France is"
LONG_PROMPT = (
    "In the beginning there was a long shared system prompt that every request of this test starts with, "
    "so that the second request finds its blocks in the prefix cache:"
)
QUESTION = "Answer in full sentences, with an example or two, and say why it matters to the people who read it today."
# The Accept headers of Prometheus 2.x (no escaping parameter) and of 3.x, by default (UTF-8 names) and with
# metric_name_validation_scheme: legacy.
ACCEPT = {
    "2.x": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "3.x": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "3.x legacy names": "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=underscores;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
}
# What Prometheus adds to every target of its own.
SYNTHETIC = {
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}


class Prometheus:
    """`prometheus` as a child process on a free loopback port, its configuration and storage in `directory`."""

    def __init__(self, config: str, directory: Path):
        (directory / "prometheus.yml").write_text(config)
        self.address = f"127.0.0.1:{free_port()}"
        self.log = directory / "prometheus.log"
        with open(self.log, "w") as log:
            self.popen = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address={self.address}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + WAIT_S
        while not self.ready():
            assert self.popen.poll() is None and time.monotonic() < deadline, (
                f"prometheus did not start: {self.log.read_text()[-2000:]}"
            )
            time.sleep(0.1)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False

    def api(self, path: str, **params):
        """The `data` of a /api/v1 answer (a list value: a repeated parameter)."""
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"http://{self.address}/api/v1/{path}?{query}", timeout=30) as reply:
            answer = json.load(reply)
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float:
        """The one value of an instant query."""
        result = self.query(expr)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])

    def scraped_after(self, t: float, jobs) -> None:
        """Wait until every job's target has been scraped, up, since t (time.time())."""

        def done():
            # timestamp() of the selector itself: the scrape's time (of an expression over it: the query's).
            scrapes = {r["metric"]["job"]: float(r["value"][1]) for r in self.query("timestamp(up)")}
            up = {r["metric"]["job"] for r in self.query("up == 1")}
            return all(scrapes.get(job, 0.0) > t and job in up for job in jobs)

        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"not every target was scraped: {self.query('up')}"
            time.sleep(0.2)

    def wait_for(self, expr: str) -> None:
        """Wait until an instant query of expr returns something."""
        deadline = time.monotonic() + WAIT_S
        while not self.query(expr):
            assert time.monotonic() < deadline, f"Prometheus never found {expr}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.popen.terminate()  # Prometheus stops at once on SIGTERM
        self.popen.wait(30)


@pytest.fixture(scope="module")
def mesh():
    with Mesh(EngineArgs(kv_cache_memory=KV), kv_store=True, env={"LLMMESH_METRICS_PORT": "0"}) as m:
        yield m


@pytest.fixture(scope="module")
def prometheus(mesh, tmp_path_factory):
    targets = {name: service.metrics_address for name, service in mesh.services.items()}
    server = Prometheus(
        scrape_config(targets, scrape_interval=f"{SCRAPE_INTERVAL_S}s"), tmp_path_factory.mktemp("prometheus")
    )
    yield server
    server.stop()


class Workload:
    """The results of the requests sent, and what the engine counted at a scrape after those that finish by length."""

    def __init__(self, gateway: str):
        self.gateway = gateway
        self.started = time.time()
        self.results = []
        self.counted = {}
        self.cancelled = 0

    def run(self, prompt: str, **params):
        result = collect(generate(self.gateway, prompt, temperature=0.0, ignore_eos=True, **params))
        self.results.append(result)
        return result


@pytest.fixture(scope="module")
def workload(mesh, prometheus):
    """Requests that move every panel of the dashboard, from the first scrape of every service on (a rate needs a
    sample before the increase)."""
    prometheus.scraped_after(time.time(), mesh.services)
    work = Workload(mesh.address)
    # A prompt stored in the KV store, found in the prefix cache, evicted by 180 tokens, then loaded from the store;
    # and once more with its stored blocks corrupted: the kvstore drops them, and the engine recomputes.
    prefix = f"{LONG_PROMPT} {LONG_PROMPT}"  # 4 full blocks
    for question in ("First", "Second"):
        work.run(f"{prefix} {question} question?", max_tokens=2)
    work.run("the" + " the" * 179, max_tokens=1)
    work.run(f"{prefix} Third question?", max_tokens=2)
    store = redis.Redis.from_url(mesh.redis.url, password=redis_password(mesh.tls_dir))  # its ACL user's
    for key in store.scan_iter("kv:*"):
        store.append(key, b"!")
    store.close()
    work.run("a" + " a" * 179, max_tokens=1)
    work.run(f"{prefix} Fourth question?", max_tokens=2)
    prometheus.scraped_after(time.time(), mesh.services)
    work.counted = {
        expr: prometheus.value(expr)
        for expr in (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "sum(vllm:request_success_total)",
            'vllm:request_success_total{finished_reason="length"}',
        )
    }
    # A stop string (the engine may have generated past it when the gateway's abort reaches it: not counted above).
    assert work.run(PROMPT, max_tokens=32, stop=[" "]).choice(0).stop_str == " "
    # Three requests of 91 tokens (6 blocks) at once: two fit the 12-block cache and the third waits; the two need a
    # 7th block each after a few tokens, and one is preempted. Cancelled once Prometheus has stored that.
    calls = [
        generate(work.gateway, f"({i}) {prefix} {QUESTION}", temperature=0.0, ignore_eos=True, max_tokens=100)
        for i in range(3)
    ]
    with ThreadPoolExecutor(len(calls)) as pool:
        streams = [pool.submit(collect, call) for call in calls]
        prometheus.wait_for("vllm:num_preemptions_total > 0 and vllm:num_requests_waiting > 0")
        cancelled = time.time()
        for call in calls:
            call.cancel()
        for stream in streams:
            with pytest.raises(grpc.RpcError):
                stream.result()
    work.cancelled = len(calls)
    # Until a scrape after the cancellations finds the engine empty: every request has ended, and been counted.
    prometheus.wait_for(
        f"vllm:num_requests_running + vllm:num_requests_waiting == 0 "
        f"and timestamp(vllm:num_requests_running) > {cancelled}"
    )
    return work


def exposed_names(address: str, accept: str = "") -> set[str]:
    """The sample names of a /metrics answer to this Accept header."""
    request = urllib.request.Request(f"http://{address}/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return {re.match(r"[^{\s]+", line).group() for line in lines if line and not line.startswith("#")}


def test_every_scraper_gets_the_documented_names(mesh, workload):
    for name, service in mesh.services.items():
        documented = exposed_names(service.metrics_address)  # the classic text format, names as registered
        assert not any(n.startswith(("vllm_", "llmmesh_")) for n in documented), name
        for version, accept in ACCEPT.items():
            assert exposed_names(service.metrics_address, accept) == documented, (name, version)
    assert "vllm:prompt_tokens_total" in exposed_names(mesh.services["engine"].metrics_address)


def test_prometheus_stores_every_series_under_its_documented_name(mesh, prometheus, workload):
    exposed = {name: exposed_names(service.metrics_address) for name, service in mesh.services.items()}
    prometheus.scraped_after(time.time(), mesh.services)
    for name in mesh.services:
        stored = set(prometheus.api("label/__name__/values", **{"match[]": f'{{job="{name}"}}'}))
        assert stored - SYNTHETIC == exposed[name], name


def test_the_compose_scrape_configuration_loads():
    """docs/observability/prometheus.yml, as Prometheus's own checker reads it."""
    check = subprocess.run(
        [Path(PROMETHEUS).with_name("promtool"), "check", "config", DOCS / "prometheus.yml"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_prometheus_counts_the_workload(prometheus, workload):
    """The engine's counters as Prometheus stored them equal what the client was told."""
    finished_by_length = workload.results[:-1]  # all but the stop string's
    counted = workload.counted
    assert counted["vllm:prompt_tokens_total"] == sum(r.complete.usage.prompt_tokens for r in finished_by_length)
    assert counted["vllm:generation_tokens_total"] == sum(
        r.complete.usage.completion_tokens for r in finished_by_length
    )
    assert counted['vllm:request_success_total{finished_reason="length"}'] == len(finished_by_length)
    assert counted["sum(vllm:request_success_total)"] == len(finished_by_length)
    # Then the stop string's request and the three cancelled ones.
    assert prometheus.value('vllm:request_success_total{finished_reason="length"}') == len(finished_by_length)
    assert prometheus.value("sum(vllm:request_success_total)") == len(workload.results) + workload.cancelled
    assert prometheus.value(
        'sum(grpc_server_handled_total{job="gateway", grpc_method="Generate", grpc_code="OK"})'
    ) == len(workload.results)


def dashboard():
    """The dashboard's model_name variable query and every panel's (title, legend, expr)."""
    board = json.loads((DOCS / "grafana-dashboard.json").read_text())
    variable = next(v for v in board["templating"]["list"] if v["name"] == "model_name")
    targets = [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in board["panels"] for t in p["targets"]]
    return variable["query"], targets


def test_every_dashboard_expression_draws_a_moving_panel(prometheus, workload):
    variable, targets = dashboard()
    assert len(targets) >= 27
    # The variable's label_values(metric, label), as Grafana asks it.
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable).groups()
    models = prometheus.api(f"label/{label}/values", **{"match[]": metric})
    assert len(models) == 1, models
    # "All" of one value, as Grafana writes it into a regex matcher (regex characters escaped, in a PromQL string).
    model_regex = re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\\\1", models[0])
    start, end = workload.started - 2 * SCRAPE_INTERVAL_S, time.time()
    no_data, flat = [], []
    for title, legend, expr in targets:
        query = expr.replace("$model_name", model_regex).replace("$__rate_interval", RATE_INTERVAL)
        # What the panel draws: the expression at every step over the workload's time.
        series = prometheus.api("query_range", query=query, start=start, end=end, step=SCRAPE_INTERVAL_S)["result"]
        points = [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]
        if not points:
            no_data.append((title, legend, query))
        elif max(points) <= 0:
            flat.append((title, legend, query))
    assert not no_data, f"dashboard expressions with no data: {no_data}"
    assert not flat, f"dashboard expressions that never rose above 0: {flat}"
