"""deploy/kubernetes/: every overlay rendered, checked against the Kubernetes schemas and KEDA's fields, and against
the services it runs (their ports, probes, drain timeouts and secrets). No cluster, no network.

The overlays use a small part of Kustomize (resources, namespace, replicas, JSON 6902 patches), which `render`
implements; where kubectl is installed its own `kubectl kustomize` must render the same objects.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.config import DEFAULT_PORTS
from services.settings import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# The oldest Kubernetes the manifests need (sidecar containers: an init container with restartPolicy Always) and the
# newest the schemas know.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
# The Secrets the manifests read and docs/deployment.md has the reader create: (name, key) -> optional.
SECRETS = {("llmmesh-redis", "password"): False, ("llmmesh-gateway", "api-key"): True}

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
    engine["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "50051"
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
            check = c[probe].get("grpc") or c[probe].get("tcpSocket")
            assert check["port"] == port, (c["name"], probe)
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
        # Readiness is the service's gRPC health (grpc.health.v1, the whole server) except where an overlay needs
        # the gateway in its Service with no engine behind it (scale to zero).
        if not (service == "gateway" and name == "scale-to-zero"):
            assert c["readinessProbe"]["grpc"] == {"port": DEFAULT_PORTS[service]}, c["name"]
        # The gateway and the kvstore are NOT_SERVING while a dependency is down: that must not restart them.
        liveness = c["livenessProbe"]
        assert ("tcpSocket" in liveness) == (service in ("gateway", "kvstore")), c["name"]
        assert window(liveness) > 0 and window(c["startupProbe"]) >= window(c["readinessProbe"])
    engine_pod = objects["StatefulSet", "engine"]["spec"]["template"]["spec"]
    (engine,) = [c for c in engine_pod["containers"] if c["name"] == "engine"]
    drain = float(flag(engine, "--shutdown-timeout"))
    # A draining engine answers NOT_SERVING: it must not be restarted for that before its drain ends.
    assert window(engine["livenessProbe"]) > drain
    # The health check waits behind at most one engine step: its timeout is the longest step's, with margin.
    assert engine["readinessProbe"]["timeoutSeconds"] == engine["livenessProbe"]["timeoutSeconds"] >= 2
    # Start covers the load and the CPU kernels' build with margin, far longer than a restart's window.
    assert window(engine["startupProbe"]) >= 2 * window(engine["livenessProbe"])


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


def test_secrets(overlay):
    _, objects = overlay
    assert not [k for k in objects if k[0] == "Secret"], "no Secret is committed: the cluster's own are used"
    refs = {}
    for _, spec in pod_specs(objects):
        for c in spec["containers"] + spec.get("initContainers", []):
            env = c.get("env", [])
            for i, e in enumerate(env):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs[ref["name"], ref["key"]] = ref.get("optional", False)
                elif re.search("PASSWORD|API_KEY|TOKEN|SECRET", e["name"]):
                    pytest.fail(f"{c['name']}: {e['name']} is not from a Secret")
                # $(VAR) expands only a variable defined before it.
                for var in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert var in [x["name"] for x in env[:i]], (c["name"], e["name"], var)
            for var in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []) + c.get("command", []))):
                assert var in [x["name"] for x in env], (c["name"], var)
    assert refs == SECRETS
    # Redis asks for the password the kvstore's URL carries.
    redis = objects["Deployment", "redis"]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    kvstore = objects["Deployment", "kvstore"]["spec"]["template"]["spec"]["containers"][0]
    url = {e["name"]: e.get("value") for e in kvstore["env"]}["LLMMESH_REDIS_URL"]
    assert url == f"redis://:$(REDIS_PASSWORD)@redis:{objects['Service', 'redis']['spec']['ports'][0]['port']}/0"


def test_docs_create_the_secrets_and_the_tls_place():
    docs = (ROOT / "docs" / "deployment.md").read_text()
    for name, _ in SECRETS:
        assert re.search(rf"kubectl[^\n]* create secret generic {name} ", docs), name
    base = (DEPLOY / "base" / "kustomization.yaml").read_text()
    assert "mesh TLS: reserved" in base and "llmmesh-mesh-tls" in base
    # The paths docs/deployment.md applies are the overlays.
    for name in OVERLAYS:
        assert f"deploy/kubernetes/overlays/{name}" in docs, name


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
    # The weights cache's directory is read by the model loader, not through a flag.
    not_flags = {"LLMMESH_CACHE_DIR"}
    for key in objects["ConfigMap", "llmmesh-config"]["data"]:
        assert any(key in f for f in flags.values()), key
    for _, c, service in llmmesh_containers(objects):
        for e in c.get("env", []):
            if e["name"].startswith("LLMMESH_") and e["name"] not in not_flags:
                assert e["name"] in flags[service], (c["name"], e["name"])
