"""The metric names gateways, endpoint pickers and dashboards read, scraped from a real engine's /metrics (a tiny
random model with LoRA on, served in this process)."""

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import InProcessService, mesh_channel
from llmmesh.v1 import engine_pb2, engine_pb2_grpc
from random_model import save_random_smollm2_shaped
from services import client
from test_models import COMMON

BLOCK_BYTES = 2 * COMMON["num_hidden_layers"] * 16 * COMMON["num_key_value_heads"] * 16 * 4  # float32 K and V
NUM_BLOCKS = 8
MAX_LORAS = 3

# The model-server protocol (the Gateway API Inference Extension's, docs/proposals/003-model-server-protocol): what a
# queue- and KV-aware endpoint picker scrapes from a model server, under vLLM's names: name -> (type, labels it
# reads).
MODEL_SERVER_PROTOCOL = {
    "vllm:num_requests_waiting": ("gauge", set()),  # TotalQueuedRequests
    "vllm:num_requests_running": ("gauge", set()),  # TotalRunningRequests
    "vllm:kv_cache_usage_perc": ("gauge", set()),  # KVCacheUtilization
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks"}),  # BlockSize, NumGPUBlocks
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
}
# Renamed by vLLM to vllm:kv_cache_usage_perc; still read by older pickers and dashboards.
DEPRECATED_ALIASES = {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("metric-names") / "model"
    save_random_smollm2_shaped(path, **COMMON)
    flags = ["--model", path, "--kv-cache-memory", str(NUM_BLOCKS * BLOCK_BYTES), "--enable-lora"]
    flags += ["--max-loras", MAX_LORAS, "--metrics-port", "0", "--shutdown-timeout", "5"]
    with InProcessService("engine", flags) as service:
        with mesh_channel(service.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            params = client.sampling_params(temperature=0.0, max_tokens=4, ignore_eos=True)
            request = engine_pb2.EngineGenerateRequest(prompt_token_ids=list(range(3, 40)), sampling_params=params)
            list(stub.Generate(request, timeout=60))
        yield service


def scrape(service) -> dict:
    """{family name: family} of the engine's /metrics."""
    port = service.server.telemetry.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return {f.name: f for f in text_string_to_metric_families(reply.read().decode())}


def test_every_metric_of_the_model_server_protocol_is_exported(engine):
    families = scrape(engine)
    for name, (kind, labels) in MODEL_SERVER_PROTOCOL.items():
        assert name in families, f"{name} is not exported"
        family = families[name]
        assert family.type == kind, (name, family.type)
        (sample,) = family.samples
        assert labels <= set(sample.labels), (name, sample.labels)


def test_the_protocols_values(engine):
    families = scrape(engine)
    (config,) = families["vllm:cache_config_info"].samples
    assert (config.labels["block_size"], config.labels["num_gpu_blocks"], config.value) == ("16", str(NUM_BLOCKS), 1)
    # The LoRA gauge: --max-loras, no adapter in use, and the time of the engine's last step as its value.
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": str(MAX_LORAS), "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert time.time() - 600 < lora.value <= time.time()
    assert 0.0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1.0


def test_the_deprecated_kv_cache_name_is_kept_beside_the_new_one(engine):
    families = scrape(engine)
    for old, new in DEPRECATED_ALIASES.items():
        assert families[old].type == families[new].type == "gauge"
        assert [(s.labels, s.value) for s in families[old].samples] == [
            (s.labels, s.value) for s in families[new].samples
        ]
        assert "Deprecated" in families[old].documentation
