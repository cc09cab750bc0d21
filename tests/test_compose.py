"""compose.yaml is well-formed, every llmmesh command in it is a real subcommand with flags it accepts, and every
LLMMESH_* variable it sets is a flag of that service's command.

This machine has no Docker engine, so the stack itself is not started here.
"""

import json
import re
from pathlib import Path

import pytest
import yaml

from mesh.kvstore.block_tag import KEY_ENV, KEY_FILE, block_key_from_env
from mesh.kvstore.connector import DEFAULTS
from mesh.tls import TLS_DIR_ENV
from services import config
from services.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def substitute_defaults(value: str) -> str:
    """Compose's ${VAR:-default} with the default, as compose does when VAR is unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def llmmesh_commands(compose):
    for name, service in compose["services"].items():
        commands = [service.get("command")]
        commands.append((service.get("healthcheck") or {}).get("test", [None])[1:] or None)
        for command in commands:
            if command and command[0] == "llmmesh":
                yield name, [substitute_defaults(str(part)) for part in command]


def test_every_service_is_an_image_or_our_build(compose):
    assert {"engine", "tokenizer", "detokenizer", "gateway", "kvstore", "sampler", "redis", "jaeger"} <= set(
        compose["services"]
    )
    for name, service in compose["services"].items():
        assert "image" in service or "build" in service, name
    for name in ("engine", "tokenizer", "detokenizer", "gateway", "kvstore", "sampler"):
        assert compose["services"][name]["build"] == "."
        assert compose["services"][name]["healthcheck"]["test"][1:3] == ["llmmesh", "health"]
    assert (ROOT / "Dockerfile").is_file()


def test_commands_parse_with_our_cli(compose):
    parser = build_parser()
    seen = set()
    for name, command in llmmesh_commands(compose):
        args = parser.parse_args(command[1:])  # argparse exits (a test failure) on an unknown flag
        seen.add(args.command)
        assert callable(args.func), name
    assert seen == {"engine", "tokenizer", "detokenizer", "gateway", "kvstore", "sampler", "health", "certs"}


def test_every_service_serves_mutual_tls_from_the_certs_volume_and_redis_has_a_user(compose):
    """The one-shot certs step fills the tls volume; every llmmesh service reads it (LLMMESH_TLS_DIR) after that step,
    its health check names it, the kvstore reads Redis's password from a file, and Redis loads the ACL."""
    services = compose["services"]
    assert services["certs"]["command"][:4] == ["llmmesh", "certs", "--dir", "/tls"]
    assert "tls:/tls" in services["certs"]["volumes"]
    parser = build_parser()
    for name in ("engine", "tokenizer", "detokenizer", "gateway", "kvstore", "sampler", "redis"):
        assert "tls:/tls:ro" in services[name]["volumes"], name
        assert services[name]["depends_on"]["certs"] == {"condition": "service_completed_successfully"}, name
        if name != "redis":
            assert services[name]["environment"]["LLMMESH_TLS_DIR"] == "/tls", name
            assert "--insecure-plaintext" not in services[name]["command"], name
            health = parser.parse_args(services[name]["healthcheck"]["test"][2:])
            assert health.identity == name, name
    kvstore = parser.parse_args(services["kvstore"]["command"][1:])
    assert kvstore.redis_password_file == "/tls/redis.password" and "llmmesh@redis" in kvstore.redis_url
    assert services["redis"]["command"][-2:] == ["--aclfile", "/tls/redis.acl"]
    # Only the gateway is published beyond the host's loopback.
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert published.pop("gateway") == ["8000:8000"]
    assert all(port.startswith("127.0.0.1:") for ports in published.values() for port in ports), published


def test_the_engines_kv_block_key_comes_from_the_certs_volume(compose, tmp_path, monkeypatch):
    """The certs step writes kv-block.key into the tls volume; the engine, which reads that volume as its credentials
    directory and is given no LLMMESH_KV_BLOCK_KEY, tags and checks its KV blocks with that key: the same for every
    engine of the store, and after a restart. Without it each start would make a key of its own."""
    services = compose["services"]
    certs = build_parser().parse_args(services["certs"]["command"][1:])
    engine = services["engine"]
    assert KEY_ENV not in engine["environment"]
    assert engine["environment"][TLS_DIR_ENV] == certs.dir and f"tls:{certs.dir}:ro" in engine["volumes"]
    certs.dir = str(tmp_path / "tls")  # the volume
    certs.func(certs)
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv(TLS_DIR_ENV, certs.dir)
    key = block_key_from_env()
    assert key == bytes.fromhex((tmp_path / "tls" / KEY_FILE).read_text()) and len(key) == 32
    assert block_key_from_env() == key
    assert (tmp_path / "tls" / KEY_FILE).stat().st_mode & 0o077 == 0
    monkeypatch.setenv(TLS_DIR_ENV, str(tmp_path / "empty"))
    assert block_key_from_env() != block_key_from_env()


def test_gateway_points_at_the_other_services(compose):
    command = [substitute_defaults(str(p)) for p in compose["services"]["gateway"]["command"]]
    args = build_parser().parse_args(command[1:])
    ports = {
        name: substitute_defaults(
            str(compose["services"][name]["command"][compose["services"][name]["command"].index("--port") + 1])
        )
        for name in ("engine", "tokenizer", "detokenizer")
    }
    assert args.engine == [f"engine:{ports['engine']}"]
    assert args.tokenizer == f"tokenizer:{ports['tokenizer']}"
    assert args.detokenizer == f"detokenizer:{ports['detokenizer']}"


def flag_value(command: list, flag: str) -> str:
    return substitute_defaults(str(command[command.index(flag) + 1]))


def test_the_engine_uses_the_kvstore_and_the_kvstore_its_redis(compose):
    """The engine's KV connector points at the kvstore's port, the kvstore at the redis service, and Redis is a
    cache: LRU eviction at maxmemory, nothing persisted."""
    services = compose["services"]
    transfer = json.loads(flag_value(services["engine"]["command"], "--kv-transfer-config"))
    assert transfer["kv_connector"] == "KVStoreConnector" and transfer["kv_role"] == "kv_both"
    kvstore_port = flag_value(services["kvstore"]["command"], "--port")
    assert transfer["kv_connector_extra_config"]["kvstore_address"] == f"kvstore:{kvstore_port}"
    assert flag_value(services["kvstore"]["command"], "--redis-url") == "redis://llmmesh@redis:6379/0"
    redis = [substitute_defaults(str(part)) for part in services["redis"]["command"]]
    assert flag_value(redis, "--maxmemory-policy") == "allkeys-lru"
    assert flag_value(redis, "--save") == "" and flag_value(redis, "--appendonly") == "no"
    assert services["kvstore"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_engine_samples_on_the_sampler_service(compose):
    services = compose["services"]
    sampler_port = flag_value(services["sampler"]["command"], "--port")
    assert flag_value(services["engine"]["command"], "--sampler-address") == f"sampler:{sampler_port}"
    assert services["engine"]["depends_on"]["sampler"]["condition"] == "service_healthy"


def docker_bytes(size: str) -> int:
    """Compose's byte values: '1gb', '512m', '64k', '100b' (units of 1024)."""
    number, unit = re.fullmatch(r"(\d+)([bkmg])b?", size.lower()).groups()
    return int(number) * 1024 ** "bkmg".index(unit)


def test_the_engine_the_sampler_and_the_kvstore_share_memory(compose):
    """The engine and the kvstore join the sampler's IPC namespace, so the engine's segments under /dev/shm are the
    sampler's and the kvstore's to map; that /dev/shm holds the engine's two logits slots at its --max-num-seqs
    (SmolLM2's vocabulary, float32) and its segment for KV loads."""
    services = compose["services"]
    assert services["sampler"]["ipc"] == "shareable"
    assert services["engine"]["ipc"] == services["kvstore"]["ipc"] == "service:sampler"
    assert services["kvstore"]["depends_on"]["sampler"]["condition"] == "service_started"
    max_num_seqs = int(substitute_defaults(services["engine"]["environment"]["LLMMESH_MAX_NUM_SEQS"]))
    needed = 2 * max_num_seqs * 49152 * 4 + DEFAULTS["shared_memory_bytes"] + 2**20
    size = services["sampler"]["shm_size"]
    assert docker_bytes(size) >= needed, f"shm_size {size} is less than the slots and the KV segment ({needed} bytes)"


def test_environment_names_real_flags(compose, monkeypatch):
    """A variable is read only if it is LLMMESH_<DEST> of one of the command's flags: a renamed flag (the gateway's
    --model became --served-model-name) would otherwise be ignored without a word."""
    checked = 0
    for name, command in llmmesh_commands(compose):
        if command[1] == "health":
            continue
        environment = {
            k: substitute_defaults(str(v)) for k, v in (compose["services"][name].get("environment") or {}).items()
        }
        subcommand = build_parser()._subparsers._group_actions[0].choices[command[1]]
        flags = {config.env_name(a.dest): a for a in subcommand._actions if a.option_strings}
        for variable, value in environment.items():
            assert variable.startswith(config.ENV_PREFIX) and variable in flags, (
                f"{name}: {variable} is no flag of `llmmesh {command[1]}`"
            )
            monkeypatch.setenv(variable, value)
        args = build_parser().parse_args(command[1:])  # the values are good ones for their flags
        for variable, value in environment.items():
            action = flags[variable]
            assert getattr(args, action.dest) == (action.type or str)(value), (name, variable)
            checked += 1
        for variable in environment:
            monkeypatch.delenv(variable)
    assert checked >= 4


def test_a_wrong_flag_would_be_caught():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--no-such-flag", "1"])


def test_every_service_is_traced_to_jaeger_and_scraped_by_prometheus(compose):
    """Each llmmesh service exports spans to the jaeger container's OTLP/gRPC port and serves /metrics on the port
    the prometheus service scrapes; the dashboard in docs/ reads vLLM's metric names."""
    services = compose["services"]
    scrape = yaml.safe_load((ROOT / "docs/observability/prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    ours = [name for name, service in services.items() if service.get("build") == "." and name != "certs"]
    for name in ours:
        environment = {k: substitute_defaults(str(v)) for k, v in services[name]["environment"].items()}
        assert environment["LLMMESH_OTLP_TRACES_ENDPOINT"] == "jaeger:4317", name
        assert f"{name}:{environment['LLMMESH_METRICS_PORT']}" in targets, name
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    volume = services["prometheus"]["volumes"][0]
    assert volume.startswith("./docs/observability/prometheus.yml:")
    dashboard = json.loads((ROOT / "docs/observability/grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "vllm:time_to_first_token_seconds",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "grpc_server_handled_total",
    ):
        assert metric in exprs, metric
