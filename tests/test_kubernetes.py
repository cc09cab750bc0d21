"""deploy/kubernetes/: every overlay rendered, checked against the Kubernetes schemas and KEDA's fields, and against
the services it runs (their ports, probes, drain timeouts, their mutual TLS and secrets), and docs/deployment.md's
commands that make the Secrets from a real `llmmesh certs` run. No cluster, no network.

The overlays use a small part of Kustomize (resources, namespace, replicas, JSON 6902 patches), which `render`
implements; where kubectl is installed its own `kubectl kustomize` must render the same objects.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from mesh import tls
from services import certs, health_probe
from services.certs import REDIS_USER
from services.config import DEFAULT_PORTS
from services.settings import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# The oldest Kubernetes the manifests need (sidecar containers: an init container with restartPolicy Always) and the
# newest the schemas know.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
# The Secrets the manifests read and docs/deployment.md has the reader create, with the keys read from each: every
# service's own credentials (its key in a Secret of its own), Redis's users, the engines' KV block key, the gateway's
# API key (optional).
TLS_MOUNT = "/etc/llmmesh/tls"
SECRETS = {
    **{f"llmmesh-tls-{s}": {"ca.crt", f"{s}.crt", f"{s}.key"} for s in DEFAULT_PORTS},
    "llmmesh-redis": {"redis.acl", "redis.password"},
    "llmmesh-kv-block-key": {"kv-block.key"},
    "llmmesh-gateway": {"api-key"},
}
OPTIONAL_SECRETS = {"llmmesh-gateway"}

# The fields KEDA documents for a ScaledObject (keda.sh/v1alpha1) and its Prometheus trigger; no others.
_PROMETHEUS_METADATA = {
    "type": "object",
    "required": ["serverAddress", "query", "threshold"],
    "additionalProperties": False,
    "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"},
        "query": {"type": "string", "minLength": 1},
        "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "namespace": {"type": "string"},
        "customHeaders": {"type": "string"},
        "ignoreNullValues": {"type": "string", "enum": ["true", "false"]},
        "queryParameters": {"type": "string"},
        "unsafeSsl": {"type": "string", "enum": ["true", "false"]},
    },
}
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "properties": {"failureThreshold": {"type": "integer"}, "replicas": {"type": "integer"}},
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metadata": {"type": "object"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
                            },
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {"properties": {"metadata": _PROMETHEUS_METADATA}},
                    },
                },
            },
        },
    },
}


# ---- rendering: the part of Kustomize the overlays use ----------------------------------------------------


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` prints."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "namespace", "resources", "replicas", "patches"}
    assert not unknown, f"{directory}: render() does not implement {sorted(unknown)}"
    objects = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += render(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in kustomization.get("patches", []):
        (target,) = [o for o in objects if matches(o, patch["target"])]
        for operation in yaml.safe_load(patch["patch"]):
            apply_json_patch(target, operation)
    for replicas in kustomization.get("replicas", []):
        (target,) = [
            o for o in objects if o["metadata"]["name"] == replicas["name"] and "replicas" in o.get("spec", {})
        ]
        target["spec"]["replicas"] = replicas["count"]
    if "namespace" in kustomization:
        for o in objects:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def matches(obj: dict, target: dict) -> bool:
    return obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]


def apply_json_patch(doc: dict, operation: dict) -> None:
    """One RFC 6902 operation: add, remove or replace."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op = operation["op"]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, operation["value"])
        elif op == "replace":
            node[index] = operation["value"]
        else:
            assert op == "remove", op
            del node[index]
    else:
        if op in ("replace", "remove"):
            assert last in node, f"{op} {operation['path']}: no such field"
        if op == "remove":
            del node[last]
        else:
            assert op in ("add", "replace"), op
            node[last] = operation["value"]


def by_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, dict[tuple[str, str], dict]]:
    return request.param, by_name(render(DEPLOY / "overlays" / request.param))


def pod_specs(objects: dict) -> list[tuple[str, dict]]:
    return [
        (name, o["spec"]["template"]["spec"]) for (kind, name), o in objects.items() if "template" in o.get("spec", {})
    ]


def llmmesh_containers(objects: dict) -> list[tuple[dict, dict, str]]:
    """(pod spec, container, service) for every long-running llmmesh container: init steps excluded, sidecars in."""
    found = []
    for _, spec in pod_specs(objects):
        sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        for c in spec["containers"] + sidecars:
            if c["image"].startswith("llmmesh"):
                assert c["command"][0] == "llmmesh", c["name"]
                found.append((spec, c, c["command"][1]))
    return found


def flag(container: dict, name: str) -> str | None:
    command = container["command"]
    return command[command.index(name) + 1] if name in command else None


def health_check(probe: dict, variables: dict[str, str] | None = None):
    """The arguments of an exec probe that runs the mesh's health check (services/health_probe.py), with the
    variables of the container it runs in (LLMMESH_*) and no others."""
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "services.health_probe"], command
    with mock.patch.dict(os.environ, variables or {}, clear=True):
        return health_probe.build_parser().parse_args(command[3:])


def probe_port(probe: dict) -> int:
    """The port a probe checks: a TCP or gRPC probe's, or the address of the mesh's health check."""
    if "exec" in probe:
        return int(health_check(probe).address.rsplit(":", 1)[1])
    return (probe.get("grpc") or probe.get("tcpSocket"))["port"]


def containers(spec: dict) -> list[dict]:
    return spec["containers"] + spec.get("initContainers", [])


def environment(objects: dict, container: dict) -> dict[str, dict]:
    """Every variable a container gets, from its ConfigMaps (envFrom) and then its own env: name -> {"value": ...} or
    {"valueFrom": ...}."""
    variables = {}
    for source in container.get("envFrom", []):
        data = objects["ConfigMap", source["configMapRef"]["name"]]["data"]
        variables.update({name: {"value": value} for name, value in data.items()})
    variables.update({e["name"]: {k: v for k, v in e.items() if k != "name"} for e in container.get("env", [])})
    return variables


def secret_files(spec: dict, container: dict) -> dict[str, tuple[str, str, int]]:
    """Every file a container mounts from a Secret: path -> (Secret, key, mode). A Secret mounted whole gives the
    keys docs/deployment.md puts in it."""
    volumes = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    files = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in volumes:
            secret = volumes[mount["name"]]
            name, mode = secret["secretName"], secret.get("defaultMode", 0o644)
            items = secret.get("items") or [{"key": key, "path": key} for key in SECRETS[name]]
            for item in items:
                files[f"{mount['mountPath']}/{item['path']}"] = (name, item["key"], item.get("mode", mode))
    return files


def secret_variables(container: dict) -> dict[str, tuple[str, str]]:
    """Every variable a container takes from a Secret: name -> (Secret, key)."""
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


# ---- the tests --------------------------------------------------------------------------------------------


def test_overlays_exist():
    assert {"dev", "autoscale", "scale-to-zero"} <= set(OVERLAYS)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", OVERLAYS)
def test_render_is_kubectl_kustomize(name):
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "overlays" / name)], capture_output=True, text=True, check=True
    ).stdout
    assert by_name([o for o in yaml.safe_load_all(out) if o]) == by_name(render(DEPLOY / "overlays" / name))


def test_every_object_is_valid(overlay):
    name, objects = overlay
    for (kind, obj_name), obj in objects.items():
        if kind == "ScaledObject":
            jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {kind}/{obj_name} against Kubernetes {version}: {e.message} at {e.path}")
        if kind != "Namespace":
            assert obj["metadata"]["namespace"] == "llmmesh", (kind, obj_name)


def test_schema_catches_what_it_should(overlay):
    """The two validators refuse what a typo makes: an unknown field, a wrong type."""
    _, objects = overlay
    engine = json.loads(json.dumps(objects["StatefulSet", "engine"]))
    engine["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"] = "python"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, KUBERNETES_VERSIONS[-1], strict=True)
    engine = json.loads(json.dumps(objects["StatefulSet", "engine"]))
    engine["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, KUBERNETES_VERSIONS[-1], strict=True)
    scaled = [o for (kind, _), o in objects.items() if kind == "ScaledObject"]
    for obj in scaled:
        bad = json.loads(json.dumps(obj))
        bad["spec"]["triggers"][0]["metadata"]["treshold"] = bad["spec"]["triggers"][0]["metadata"].pop("threshold")
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCALED_OBJECT_SCHEMA)


def test_every_service_runs(overlay):
    _, objects = overlay
    services = {service for _, _, service in llmmesh_containers(objects)}
    assert services == set(DEFAULT_PORTS)
    assert ("Deployment", "redis") in objects and ("Service", "redis") in objects


def test_ports_match_the_services_defaults(overlay):
    _, objects = overlay
    for _, c, service in llmmesh_containers(objects):
        port = DEFAULT_PORTS[service]
        assert flag(c, "--port") == str(port), c["name"]
        assert flag(c, "--host") == "0.0.0.0", c["name"]  # the probes and the other pods reach the pod's address
        assert port in [p["containerPort"] for p in c["ports"]], c["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe_port(c[probe]) == port, (c["name"], probe)
        # A Service of the service's name sends its port to that container's port.
        svc = objects.get(("Service", service))
        if svc is not None:
            (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
            named = {p["name"]: p["containerPort"] for p in c["ports"] if "name" in p}
            assert svc_port["port"] == port and named[svc_port["targetPort"]] == port, service
    # Metrics ports differ between containers of one pod.
    for _, spec in pod_specs(objects):
        ports = [
            p["containerPort"] for c in spec["containers"] + spec.get("initContainers", []) for p in c.get("ports", [])
        ]
        assert len(ports) == len(set(ports))


def addresses(objects: dict) -> list[tuple[str, str, dict]]:
    """(host, port, pod spec) of every address a service is given: flags, the engines' list, the KV connector."""
    found = []
    for spec, c, _ in llmmesh_containers(objects):
        values = [flag(c, f) for f in ("--tokenizer", "--detokenizer", "--sampler-address")]
        values += [e["value"] for e in c.get("env", []) if e["name"] == "LLMMESH_ENGINE"]
        transfer = flag(c, "--kv-transfer-config")
        if transfer:
            values.append(json.loads(transfer)["kv_connector_extra_config"]["kvstore_address"])
        for value in filter(None, values):
            for address in value.split(","):
                host, port = address.rsplit(":", 1)
                found.append((host, port, spec))
    return found


def test_addresses_name_services_and_their_ports(overlay):
    _, objects = overlay
    engine = objects["StatefulSet", "engine"]
    listed = 0
    for host, port, spec in addresses(objects):
        if host == "127.0.0.1":  # a container of the same pod
            services = [
                c["command"][1] for c in spec["containers"] + spec.get("initContainers", []) if c.get("command")
            ]
            assert int(port) in [DEFAULT_PORTS[s] for s in services if s in DEFAULT_PORTS]
            continue
        pod, _, service = host.partition(".")
        if service:  # a StatefulSet pod through its headless Service: NAME-INDEX.SERVICE
            assert service == engine["spec"]["serviceName"] and re.fullmatch(r"engine-\d+", pod), host
            assert objects["Service", service]["spec"]["clusterIP"] == "None"
            listed += 1
            service = "engine"
        else:
            service = pod
        assert ("Service", service) in objects, host
        assert int(port) == DEFAULT_PORTS[service], host
    # The gateway lists every engine the StatefulSet may have.
    most = max([o["spec"]["maxReplicaCount"] for (k, _), o in objects.items() if k == "ScaledObject"], default=0)
    assert listed >= max(most, engine["spec"].get("replicas", 1))


def window(probe: dict) -> int:
    """Seconds of failing checks before the kubelet acts on the probe."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_probes(overlay):
    name, objects = overlay
    for _, c, service in llmmesh_containers(objects):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, (c["name"], probe)
            # No gRPC probe: Kubernetes' presents no certificate, so it cannot reach a mutual TLS port.
            assert "grpc" not in c[probe], (c["name"], probe)
            if "exec" in c[probe]:
                # The service's gRPC health (grpc.health.v1, the whole server) over mutual TLS, presenting the
                # service's own certificate from the container's credentials (LLMMESH_TLS_DIR), answered in time.
                variables = {k: v["value"] for k, v in environment(objects, c).items() if "value" in v}
                check = health_check(c[probe], variables)
                assert check.identity == service and check.address == f"127.0.0.1:{DEFAULT_PORTS[service]}"
                assert not check.insecure_plaintext and check.tls_dir == TLS_MOUNT and check.service == ""
                assert c[probe]["timeoutSeconds"] > check.timeout, (c["name"], probe)
        # Readiness is the service's gRPC health except where an overlay needs the gateway in its Service with no
        # engine behind it (scale to zero).
        if not (service == "gateway" and name == "scale-to-zero"):
            assert "exec" in c["readinessProbe"], c["name"]
        # The gateway and the kvstore are NOT_SERVING while a dependency is down: that must not restart them.
        liveness = c["livenessProbe"]
        assert ("tcpSocket" in liveness) == (service in ("gateway", "kvstore")), c["name"]
        assert window(liveness) > 0 and window(c["startupProbe"]) >= window(c["readinessProbe"])
    engine_pod = objects["StatefulSet", "engine"]["spec"]["template"]["spec"]
    (engine,) = [c for c in engine_pod["containers"] if c["name"] == "engine"]
    drain = float(flag(engine, "--shutdown-timeout"))
    # A draining engine answers NOT_SERVING: it must not be restarted for that before its drain ends.
    assert window(engine["livenessProbe"]) > drain
    # The health check waits behind at most one engine step: its timeout is the longest step's (2.4 s), with margin.
    assert engine["readinessProbe"]["timeoutSeconds"] == engine["livenessProbe"]["timeoutSeconds"]
    assert health_check(engine["readinessProbe"]).timeout == health_check(engine["livenessProbe"]).timeout >= 5
    # Start covers the load and the CPU kernels' build with margin, far longer than a restart's window.
    assert window(engine["startupProbe"]) >= 2 * window(engine["livenessProbe"])


def test_the_health_check_loads_no_torch():
    """The probes run it every few seconds, in the limit of the container they probe: gRPC and the credentials only,
    not the services' imports."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, services.health_probe; print(sorted(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "'grpc'" in loaded and "'torch'" not in loaded and "'transformers'" not in loaded


def test_shutdown(overlay):
    _, objects = overlay
    for spec, c, _ in llmmesh_containers(objects):
        drain = float(flag(c, "--shutdown-timeout") or ServerConfig.shutdown_timeout)
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert pre_stop[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain, c["name"]
    engine_pod = objects["StatefulSet", "engine"]["spec"]["template"]["spec"]
    # The sampler is a sidecar: it stops only after the engine, whose draining requests still sample on it.
    (sampler,) = [c for c in engine_pod["initContainers"] if c["name"] == "sampler"]
    assert sampler["restartPolicy"] == "Always"
    budgets = [o for (kind, _), o in objects.items() if kind == "PodDisruptionBudget"]
    for kind, workload in (("StatefulSet", "engine"), ("Deployment", "gateway")):
        obj = objects[kind, workload]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        # A budget that lets no pod go would block every node drain.
        replicas = obj["spec"].get("replicas", 1)
        assert budget["spec"].get("maxUnavailable", 0) >= 1 or budget["spec"]["minAvailable"] < replicas, workload


def test_resources(overlay):
    _, objects = overlay
    for _, spec in pod_specs(objects):
        for c in spec["containers"] + spec.get("initContainers", []):
            resources = c["resources"]
            assert resources["requests"]["memory"] == resources["limits"]["memory"] or c["name"] in (
                "kvstore",
                "tokenizer",
                "detokenizer",
                "gateway",
                "prepare-model",
            ), c["name"]
            assert "cpu" in resources["requests"], c["name"]


def test_every_service_serves_mutual_tls_with_its_own_key_alone(overlay):
    """Each llmmesh container reads the mesh's credentials from LLMMESH_TLS_DIR, where its own service's Secret is
    mounted (the CA's certificate, its certificate and key, readable by its user alone), and reaches no other
    secret than those its service needs: no other service's key, in its pod or elsewhere."""
    _, objects = overlay
    needs = {
        "engine": {("llmmesh-kv-block-key", "kv-block.key")},
        "kvstore": {("llmmesh-redis", "redis.password")},
        "gateway": {("llmmesh-gateway", "api-key")},
    }
    for spec, c, service in llmmesh_containers(objects):
        env = environment(objects, c)
        assert env[tls.TLS_DIR_ENV] == {"value": TLS_MOUNT}, c["name"]
        assert tls.PLAINTEXT_ENV not in env and "--insecure-plaintext" not in c["command"], c["name"]
        files = secret_files(spec, c)
        own = f"llmmesh-tls-{service}"
        for name in ("ca.crt", f"{service}.crt", f"{service}.key"):
            secret, key, mode = files[f"{TLS_MOUNT}/{name}"]
            assert (secret, key) == (own, name) and mode & 0o077 == 0, (c["name"], name, oct(mode))
        reached = {(secret, key) for secret, key, _ in files.values()} | set(secret_variables(c).values())
        assert reached == {(own, key) for key in SECRETS[own]} | needs.get(service, set()), c["name"]
    # No other container (an init step, Redis) mounts a service's key.
    served = [c for _, c, _ in llmmesh_containers(objects)]
    for _, spec in pod_specs(objects):
        for c in containers(spec):
            if c not in served:
                assert not [s for s, _, _ in secret_files(spec, c).values() if s.startswith("llmmesh-tls-")], c["name"]


def test_redis_admits_the_kvstores_user_alone(overlay):
    """Redis loads the ACL file `llmmesh certs` writes; the kvstore logs in as its user with the password from a
    file; Redis's own user reads the ACL file, and the password is readable by root alone."""
    _, objects = overlay
    redis_spec = objects["Deployment", "redis"]["spec"]["template"]["spec"]
    (redis,) = redis_spec["containers"]
    files = secret_files(redis_spec, redis)
    acl = redis["args"][redis["args"].index("--aclfile") + 1]
    assert files[acl][:2] == ("llmmesh-redis", "redis.acl") and files[acl][2] & 0o004  # redis-server is not root
    assert "--requirepass" not in redis["args"]
    kvstore_spec = objects["Deployment", "kvstore"]["spec"]["template"]["spec"]
    (kvstore,) = kvstore_spec["containers"]
    password = secret_files(kvstore_spec, kvstore)[flag(kvstore, "--redis-password-file")]
    assert password[:2] == ("llmmesh-redis", "redis.password") and password[2] & 0o077 == 0
    port = objects["Service", "redis"]["spec"]["ports"][0]["port"]
    assert flag(kvstore, "--redis-url") == f"redis://{REDIS_USER}@redis:{port}/0"


def strings(obj) -> list[str]:
    """Every string in a nested object."""
    if isinstance(obj, str):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    return [s for value in values for s in strings(value)]


def secrets_on_command_lines(container: dict) -> list[str]:
    """The words of a container's command lines (command, args, probes, hooks) and plain variables that carry a
    secret: a Secret's variable expanded, a password in a URL or a flag, a key's hex or PEM."""
    from_secrets = set(secret_variables(container))
    words = [*container.get("command", []), *container.get("args", [])]
    words += [e["value"] for e in container.get("env", []) if "value" in e]
    for hook in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        words += strings(container.get(hook, {}))
    leaks = []
    for word in words:
        if (
            set(re.findall(r"\$\((\w+)\)", word)) & from_secrets
            or re.search(r"rediss?://[^/@]*:[^/@]+@", word)
            or re.fullmatch(r"--(requirepass|masterauth|api-key|password)(=.*)?", word)
            or re.search(r"[0-9a-fA-F]{32}|BEGIN [A-Z ]*PRIVATE KEY", word)
        ):
            leaks.append(word)
    return leaks


def test_no_secret_on_a_command_line(overlay):
    """Keys and passwords reach a container as files or variables from Secrets, never in a command line (which every
    process of the node sees in /proc, and anyone who may read the pod in its spec) nor in a URL; a variable that
    looks secret comes from a Secret. No Secret is committed: the cluster's own are used."""
    _, objects = overlay
    assert not [k for k in objects if k[0] == "Secret"]
    read = {}
    for _, spec in pod_specs(objects):
        for c in containers(spec):
            assert not secrets_on_command_lines(c), (c["name"], secrets_on_command_lines(c))
            for e in c.get("env", []):
                if re.search("PASSWORD|API_KEY|TOKEN|SECRET|_KEY$|AUTH", e["name"]):
                    assert e["name"] in secret_variables(c), f"{c['name']}: {e['name']} is not from a Secret"
            for e in c.get("env", []):
                if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                    read.setdefault(ref["name"], set()).add(ref["key"])
                    assert ref.get("optional", False) == (ref["name"] in OPTIONAL_SECRETS), ref
            for secret, key, _ in secret_files(spec, c).values():
                read.setdefault(secret, set()).add(key)
    # Every Secret the docs make is read, with the keys they put in it.
    assert read == SECRETS


def test_the_command_line_check_catches_what_it_should():
    """The forms a secret took in these manifests before: a password in the kvstore's Redis URL, Redis's
    --requirepass, a key given as a flag."""
    env = [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "llmmesh-redis", "key": "password"}}}]
    for container in (
        {"command": ["llmmesh", "kvstore", "--redis-url", "redis://:$(REDIS_PASSWORD)@redis:6379/0"], "env": env},
        {"env": [*env, {"name": "LLMMESH_REDIS_URL", "value": "redis://:$(REDIS_PASSWORD)@redis:6379/0"}]},
        {"args": ["--requirepass", "$(REDIS_PASSWORD)"], "env": env},
        {"command": ["llmmesh", "gateway", "--api-key", "x"]},
        {"command": ["llmmesh", "engine"], "readinessProbe": {"exec": {"command": ["x", "ab" * 32]}}},
    ):
        assert secrets_on_command_lines(container), container


def docs_commands() -> list[list[str]]:
    """The commands of docs/deployment.md's Kubernetes section, one argv each: continued lines joined, a `for VAR in
    ...; do ... done` loop unrolled, comments left out."""
    docs = (ROOT / "docs" / "deployment.md").read_text()
    section = docs.split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"^ *```sh\n(.*?)^ *```", section, re.DOTALL | re.MULTILINE):
        block = re.sub(r"\\\n\s*", " ", block)

        def unroll(loop: re.Match) -> str:
            variable, values, body = loop.groups()
            return "\n".join(body.replace(f"${variable}", value) for value in values.split())

        block = re.sub(r"^ *for (\w+) in ([^;]+); do\n(.*?)^ *done$", unroll, block, flags=re.DOTALL | re.MULTILINE)
        commands += [argv for line in block.splitlines() if (argv := shlex.split(line, comments=True))]
    return commands


def test_docs_make_the_secrets_from_llmmesh_certs(tmp_path):
    """docs/deployment.md's `llmmesh certs` command, run for real, then its `kubectl create secret` commands: each
    Secret the manifests read, in the namespace, with the keys they read, from files that command wrote; the
    gateway's certificate names the gateway's Service in the cluster."""
    commands = docs_commands()
    (certs_argv,) = [argv for argv in commands if argv[:2] == ["llmmesh", "certs"]]
    parser = argparse.ArgumentParser()
    certs.add_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(certs_argv[1:])
    directory = args.dir
    args.dir = str(tmp_path / directory)
    args.func(args)
    namespace = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())["namespace"]
    made = {}
    for argv in commands:
        if argv[:1] != ["kubectl"] or "secret" not in argv:
            continue
        assert argv[argv.index("-n") + 1] == namespace, argv
        kind, name, *sources = argv[argv.index("secret") + 1 :]
        assert argv[argv.index("secret") - 1] == "create" and kind == "generic", argv
        keys = set()
        for source in sources:
            option, _, value = source.partition("=")
            if option == "--from-file":
                key, _, path = value.rpartition("=")
                assert path.startswith(f"{directory}/") and (tmp_path / path).is_file(), (name, path)
                keys.add(key or Path(path).name)
            else:
                assert option == "--from-literal", source
                keys.add(value.split("=", 1)[0])
        made[name] = keys
    assert made == SECRETS
    gateway = x509.load_pem_x509_certificate((tmp_path / directory / "gateway.crt").read_bytes())
    names = gateway.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert {f"gateway.{namespace}", f"gateway.{namespace}.svc"} <= set(names)
    # The paths docs/deployment.md applies are the overlays.
    docs = (ROOT / "docs" / "deployment.md").read_text()
    for overlay_name in OVERLAYS:
        assert f"deploy/kubernetes/overlays/{overlay_name}" in docs, overlay_name


def test_autoscaling(overlay):
    name, objects = overlay
    scaled = [o for (kind, _), o in objects.items() if kind == "ScaledObject"]
    if name == "dev":
        assert not scaled
        return
    (obj,) = scaled
    spec = obj["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) in objects and target["apiVersion"] == "apps/v1"
    assert "replicas" not in objects[target["kind"], target["name"]]["spec"]  # KEDA owns the count
    queue = [t for t in spec["triggers"] if "vllm:num_requests_waiting" in t["metadata"]["query"]]
    assert len(queue) == 1 and queue[0]["type"] == "prometheus" and float(queue[0]["metadata"]["threshold"]) > 0
    if name == "scale-to-zero":
        assert spec["minReplicaCount"] == 0
        # Something other than the engines' own queue wakes the first engine.
        assert any("activationThreshold" in t["metadata"] and t not in queue for t in spec["triggers"])
    else:
        assert spec["minReplicaCount"] >= 1


def test_variables_are_flags_of_their_service(overlay):
    """Every LLMMESH_* a container sets is a flag its service reads (an unknown one would be ignored)."""
    from services.cli import build_parser
    from services.config import env_name

    _, objects = overlay
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {name: {env_name(a.dest) for a in p._actions if a.option_strings} for name, p in commands.items()}
    # The weights cache's directory is read by the model loader, the KV block key by the engine's KV connector
    # (mesh/kvstore/block_tag.py), not through a flag.
    not_flags = {"LLMMESH_CACHE_DIR", "LLMMESH_KV_BLOCK_KEY"}
    for key in objects["ConfigMap", "llmmesh-config"]["data"]:
        assert any(key in f for f in flags.values()), key
    for _, c, service in llmmesh_containers(objects):
        for e in c.get("env", []):
            if e["name"].startswith("LLMMESH_") and e["name"] not in not_flags:
                assert e["name"] in flags[service], (c["name"], e["name"])
