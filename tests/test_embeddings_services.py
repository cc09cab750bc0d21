"""Embeddings served: the gateway's Embed RPC and the engine's (llmmesh.v1.Engine, vLLM's VllmEngine) over real
gRPC servers in this process, on a tiny random Qwen3Model (last-token pooling, normalised) checked against Hugging
Face; what they refuse; and one call through smg's OpenAI /v1/embeddings with the `openai` client."""

import contextlib
import importlib.util
import re
import time

import grpc
import pytest
import torch
import torch.nn.functional as F
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from test_embeddings import ATOL, hf_hidden_states, save_base_model
from test_interop import SmgRouter, free_port, smg_missing

from conftest import InProcessService, mesh_channel
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from random_model import save_word_level_tokenizer
from test_models import COMMON

FLAGS = ["--kv-cache-memory", "8MiB", "--block-size", "8"]
PROMPT = [5, 17, 300, 42, 9, 88, 123, 7, 61, 200, 3]


class EmbeddingMesh:
    """An engine serving the embedding model, the text services and a gateway; and a generating engine (a causal
    Llama) with a gateway of its own over the same text services. Each is closed by `stack`, the last first."""

    def __init__(self, stack: contextlib.ExitStack, model_dir, generative_dir):
        def start(name: str, service: str, flags) -> None:
            self.services[name] = stack.enter_context(InProcessService(service, [*flags, "--shutdown-timeout", "5"]))
            self.channels[name] = stack.enter_context(mesh_channel(self.services[name].address))
            if service == "engine":  # vLLM's protocol is the router's to call (mesh/tls.py)
                self.router_channels[name] = stack.enter_context(mesh_channel(self.services[name].address, "router"))

        self.services, self.channels, self.router_channels = {}, {}, {}
        # smg reaches workers in plaintext only: the embedding engine's VllmEngine also on a loopback port for it
        self.vllm_plaintext_address = f"127.0.0.1:{free_port()}"
        plain = ["--vllm-plaintext-port", self.vllm_plaintext_address.rsplit(":", 1)[1]]
        start("engine", "engine", ["--model", model_dir, *FLAGS, *plain])
        start("generative", "engine", ["--model", generative_dir, *FLAGS])
        for name in ("tokenizer", "detokenizer"):
            start(name, name, ["--model", model_dir])
        text = [f for n in ("tokenizer", "detokenizer") for f in (f"--{n}", self.services[n].address)]
        for gateway, engine in (("gateway", "engine"), ("generative-gateway", "generative")):
            start(gateway, "gateway", ["--engine", self.services[engine].address, *text])

    def gateway(self, name: str = "gateway") -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(self.channels[name])

    def engine(self, name: str = "engine") -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channels[name])

    def vllm(self, name: str = "engine") -> vllm_engine_pb2_grpc.VllmEngineStub:
        return vllm_engine_pb2_grpc.VllmEngineStub(self.router_channels[name])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("qwen3-embedding")
    config = transformers.Qwen3Config(**{**COMMON, "head_dim": 32}, architectures=["Qwen3Model"])
    return path, save_base_model(path, config, "lasttoken", normalize=True)


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    import transformers

    generative = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON)).save_pretrained(generative)
    save_word_level_tokenizer(generative, COMMON["vocab_size"])
    with contextlib.ExitStack() as stack:
        yield EmbeddingMesh(stack, model[0], generative)


def expected(hf, prompt, normalize=True) -> torch.Tensor:
    last = hf_hidden_states(hf, prompt)[-1]
    return F.normalize(last, dim=-1) if normalize else last


def assert_embedding(got, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(list(got)), want, atol=ATOL, rtol=0)


def abort_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_gateway_embed_text_and_token_ids_match_hf(mesh, model):
    hf = model[1]
    gateway = mesh.gateway()
    text = " ".join(f"<{t}>" for t in PROMPT)  # the test tokenizer: one word a token id
    by_text = gateway.Embed(gateway_pb2.EmbedRequest(text=text, request_id="e1"), timeout=60)
    assert by_text.request_id == "e1"
    assert_embedding(by_text.embedding, expected(hf, PROMPT))
    assert by_text.usage.prompt_tokens == len(PROMPT) and by_text.usage.completion_tokens == 0
    by_ids = gateway.Embed(gateway_pb2.EmbedRequest(token_ids=common_pb2.TokenIds(ids=PROMPT)), timeout=60)
    assert list(by_ids.embedding) == list(by_text.embedding)
    assert by_ids.request_id and by_ids.usage.cached_tokens == 8  # the first full block, cached by the first call
    raw = gateway.Embed(gateway_pb2.EmbedRequest(token_ids=common_pb2.TokenIds(ids=PROMPT), normalize=False))
    assert_embedding(raw.embedding, expected(hf, PROMPT, normalize=False))


@pytest.mark.parametrize(
    "request_, message",
    [
        (gateway_pb2.EmbedRequest(), "input is empty: set text or token_ids"),
        (gateway_pb2.EmbedRequest(token_ids=common_pb2.TokenIds()), "token_ids: the prompt is empty"),
        (
            gateway_pb2.EmbedRequest(token_ids=common_pb2.TokenIds(ids=[3] * 257)),
            r"token_ids: the prompt \(length 257\) is longer than the maximum model length of 256",
        ),
        (gateway_pb2.EmbedRequest(token_ids=common_pb2.TokenIds(ids=[3, 9999])), "token_ids: token id 9999 is out"),
        (gateway_pb2.EmbedRequest(text="<3>", model="sql"), "model 'sql' is not served here"),
    ],
)
def test_gateway_embed_refuses_bad_input_naming_the_field(mesh, request_, message):
    error = abort_of(lambda: mesh.gateway().Embed(request_, timeout=60))
    code = grpc.StatusCode.NOT_FOUND if request_.model else grpc.StatusCode.INVALID_ARGUMENT
    assert error.code() == code
    assert re.search(message, error.details()), error.details()


def test_each_runner_refuses_the_other_kind_of_call(mesh):
    ids = common_pb2.TokenIds(ids=PROMPT)
    error = abort_of(lambda: mesh.gateway("generative-gateway").Embed(gateway_pb2.EmbedRequest(token_ids=ids)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the engines run --runner generate" in error.details()
    generate = gateway_pb2.GenerateRequest(token_ids=ids)
    error = abort_of(lambda: list(mesh.gateway().Generate(generate, timeout=60)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "--runner pooling" in error.details()
    # The engines themselves, in both protocols.
    embed = engine_pb2.EngineEmbedRequest(request_id="x", prompt_token_ids=PROMPT)
    error = abort_of(lambda: mesh.engine("generative").Embed(embed, timeout=60))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "runs --runner generate" in error.details()
    vllm_embed = vllm_engine_pb2.EmbedRequest(
        request_id="y", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT)
    )
    error = abort_of(lambda: mesh.vllm("generative").Embed(vllm_embed, timeout=60))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    engine_generate = engine_pb2.EngineGenerateRequest(request_id="z", prompt_token_ids=PROMPT)
    error = abort_of(lambda: list(mesh.engine().Generate(engine_generate, timeout=60)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "runs --runner pooling" in error.details()


def test_engine_embed_in_both_protocols(mesh, model):
    hf = model[1]
    info = mesh.engine().GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=60)
    assert info.runner_type == "pooling" and info.architecture == "Qwen3Model"
    assert mesh.engine("generative").GetModelInfo(engine_pb2.GetModelInfoRequest()).runner_type == "generate"
    reply = mesh.engine().Embed(
        engine_pb2.EngineEmbedRequest(request_id="a", prompt_token_ids=PROMPT[:5], normalize=False), timeout=60
    )
    assert_embedding(reply.embedding, expected(hf, PROMPT[:5], normalize=False))
    assert reply.num_prompt_tokens == 5
    vllm = mesh.vllm()
    assert not vllm.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=60).is_generation
    tokenized = vllm_engine_pb2.TokenizedInput(input_ids=PROMPT[:7])
    reply = vllm.Embed(vllm_engine_pb2.EmbedRequest(request_id="b", tokenized=tokenized), timeout=60)
    assert_embedding(reply.embedding, expected(hf, PROMPT[:7]))
    assert (reply.prompt_tokens, reply.embedding_dim) == (7, COMMON["hidden_size"])
    empty = vllm_engine_pb2.EmbedRequest(request_id="c", tokenized=vllm_engine_pb2.TokenizedInput())
    error = abort_of(lambda: vllm.Embed(empty, timeout=60))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("tokenized.input_ids: the prompt is empty")


def openai_missing() -> str | None:
    if importlib.util.find_spec("openai") is None:
        return "the openai client is not installed: pip install openai (in the dev extra)"
    return smg_missing()


def wait_for_embeddings(router: SmgRouter, client, timeout: float = 90.0) -> str:
    """smg lists the model, then registers its tokenizer: poll until one embedding comes back; the model id."""
    import openai

    deadline, last = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        if router.popen.poll() is not None:
            raise RuntimeError(f"smg exited with {router.popen.returncode}:\n{router.log.read_text()[-4000:]}")
        try:
            models = client.models.list().data
            if models:
                client.embeddings.create(model=models[0].id, input="<3>")
                return models[0].id
        except openai.APIError as e:  # e.g. 503 while the worker or its tokenizer registers
            last = repr(e)
        time.sleep(0.5)
    raise TimeoutError(f"smg could not embed after {timeout:.0f} s ({last}):\n{router.log.read_text()[-4000:]}")


def test_openai_client_embeddings_through_smg(mesh, model, tmp_path):
    reason = openai_missing()
    if reason:
        pytest.skip(reason)
    import openai

    path, hf = model
    router = SmgRouter([mesh.vllm_plaintext_address], path, tmp_path / "smg.log")
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", timeout=60, max_retries=0)
        model_id = wait_for_embeddings(router, client)
        # One input a request: smg 1.13 answers a list of inputs with one embedding.
        response = client.embeddings.create(model=model_id, input=" ".join(f"<{t}>" for t in PROMPT))
        short = client.embeddings.create(model=model_id, input="<9> <4> <200>", encoding_format="float")
    finally:
        router.stop()
    assert len(response.data) == 1 and response.data[0].index == 0
    assert_embedding(response.data[0].embedding, expected(hf, PROMPT))
    assert response.usage.prompt_tokens == len(PROMPT)
    assert_embedding(short.data[0].embedding, expected(hf, [9, 4, 200]))
