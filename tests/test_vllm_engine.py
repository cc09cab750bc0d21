"""vllm.grpc.engine.VllmEngine (smg-grpc-proto) on the engine service (in-process), checked against the offline LLM."""

import asyncio
import hashlib
import io
import time
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from test_engine_service import KV_CACHE_MEMORY, llm  # noqa: F401 (llm is a fixture)

from conftest import InProcessService, aio_mesh_channel, mesh_channel
from engine import SamplingParams

PROMPT = "Write one sentence about the sea:"


@pytest.fixture(scope="module")
def engine_address():
    flags = ["--kv-cache-memory", KV_CACHE_MEMORY, "--enable-kv-cache-events", "--shutdown-timeout", "5"]
    with InProcessService("engine", flags) as engine:
        yield engine.address


@pytest.fixture(scope="module")
def stub(engine_address):
    with mesh_channel(engine_address, "router") as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def generate_request(prompt_ids, stream=True, **params) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt_ids),
        sampling_params=vllm_engine_pb2.SamplingParams(skip_special_tokens=True, **params),
        stream=stream,
    )


def offline(llm, prompt_ids, **params):
    return llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_health_and_info(engine_address, stub, llm):
    with mesh_channel(engine_address) as channel:
        status = (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine"))
            .status
        )
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest()).healthy
    info = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
    assert info.is_generation and info.vocab_size == llm.engine.model_config.vocab_size
    assert list(info.eos_token_ids) == llm.engine.model_config.eos_token_ids
    assert info.max_context_length == llm.engine.max_model_len and info.model_type == "llama"
    server = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert server.block_size == 16 and server.max_num_seqs == 256 and server.uptime_seconds > 0
    loads = stub.GetLoads(vllm_engine_pb2.GetLoadsRequest())
    assert loads.dp_rank_count == 1
    load = loads.loads[0]
    assert (load.num_running_reqs, load.num_waiting_reqs, load.token_usage) == (0, 0, 0.0)
    assert load.max_total_num_tokens == llm.engine.num_blocks * 16


def test_greedy_stream_and_unary_equal_llm(stub, llm):
    prompt = llm.tokenizer.encode(PROMPT)
    expected = list(offline(llm, prompt, temperature=0.0, max_tokens=16, ignore_eos=True).token_ids)

    messages = list(stub.Generate(generate_request(prompt, temperature=0.0, max_tokens=16, ignore_eos=True)))
    chunks = [m.chunk for m in messages if m.WhichOneof("response") == "chunk"]
    completes = [m.complete for m in messages if m.WhichOneof("response") == "complete"]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert all(c.prompt_tokens == len(prompt) and c.index == 0 for c in chunks)
    # completion_tokens counts each chunk's own tokens, as vLLM's servicer does (the router adds them up).
    assert len(chunks) > 1 and all(c.completion_tokens == len(c.token_ids) for c in chunks)
    assert sum(c.completion_tokens for c in chunks) == 16
    # The complete comes last and carries the final step's tokens, as vLLM's servicer sends it.
    assert messages[-1].WhichOneof("response") == "complete" and len(completes) == 1
    assert completes[0].finish_reason == "length" and list(completes[0].output_ids) == expected[-1:]

    [unary] = list(
        stub.Generate(generate_request(prompt, stream=False, temperature=0.0, max_tokens=16, ignore_eos=True))
    )
    assert list(unary.complete.output_ids) == expected and unary.complete.completion_tokens == 16


def test_logprobs_and_n(stub, llm):
    prompt = llm.tokenizer.encode(PROMPT)
    params = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, n=2, logprobs=3)
    messages = list(stub.Generate(generate_request(prompt, stream=False, **params)))
    completes = sorted((m.complete for m in messages), key=lambda c: c.index)
    assert [c.index for c in completes] == [0, 1]
    reference = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params), use_tqdm=False)[0].outputs
    for complete, ref in zip(completes, reference):
        assert list(complete.output_ids) == list(ref.token_ids)
        lp = complete.output_logprobs
        assert list(lp.token_ids) == list(ref.token_ids) and len(lp.top_logprobs) == 6
        for token_id, value, top, ref_entry in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs, ref.logprobs):
            assert value == pytest.approx(ref_entry[token_id].logprob, abs=1e-4)
            assert len(top.token_ids) == 3 and list(top.values) == sorted(top.values, reverse=True)


def test_stop_string_is_honoured_by_the_engine(stub, llm):
    prompt = llm.tokenizer.encode(PROMPT)
    full = offline(llm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
    # Two words from the middle of the greedy text (more than one token): the request must end there.
    words = full.text.split()
    stop = " ".join(words[2:4])
    assert len(llm.tokenizer.encode(stop, add_special_tokens=False)) > 1 and full.text.index(stop) > 0
    expected = offline(llm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 24

    messages = list(
        stub.Generate(generate_request(prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    )
    tokens = [t for m in messages if m.WhichOneof("response") == "chunk" for t in m.chunk.token_ids]
    complete = messages[-1].complete
    assert tokens == list(expected.token_ids)
    assert complete.finish_reason == "stop" and complete.matched_stop_str == stop
    assert _settles(stub)  # the engine request ended with it


def _settles(stub, within=30.0) -> bool:
    """Whether the engine runs nothing within `within` s (its load has no event: this polls; the bound only
    keeps a broken abort from hanging the test)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if stub.GetLoads(vllm_engine_pb2.GetLoadsRequest()).loads[0].num_running_reqs == 0:
            return True
        time.sleep(0.01)
    return False


def test_abort_and_bad_input(stub, llm):
    prompt = llm.tokenizer.encode(PROMPT)
    call = stub.Generate(
        vllm_engine_pb2.GenerateRequest(
            request_id="vllm-abort",
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True),
            stream=True,
        )
    )
    next(call)
    stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["vllm-abort"]))
    last = list(call)[-1]
    assert last.complete.finish_reason == "abort"
    assert _settles(stub)

    for field, params in [("temperature", dict(temperature=-1.0)), ("logprobs", dict(logprobs=50))]:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_request(prompt, **params)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generate_request(prompt, regex="[a-z")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("structured_outputs.regex does not compile")
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(vllm_engine_pb2.EmbedRequest(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt)))
    # A generating engine does not embed (tests/test_embeddings_services.py has a pooling one that does).
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "runs --runner generate" in err.value.details()


def test_get_tokenizer_zip(stub, llm):
    chunks = list(stub.GetTokenizer(smg_common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names


def test_kv_events_stream_stored_blocks(engine_address, llm):
    # A fresh 40-token prompt fills two blocks of 16; both must be announced with their tokens.
    prompt = llm.tokenizer.encode("Kv events test: " + "alpha beta gamma delta " * 8)[:40]

    async def run():
        async with aio_mesh_channel(engine_address, "router") as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            events = stub.SubscribeKvEvents(smg_common_pb2.SubscribeKvEventsRequest())
            await events.initial_metadata()  # the engine answers once it has subscribed us
            async for _ in stub.Generate(generate_request(prompt, temperature=0.0, max_tokens=2, ignore_eos=True)):
                pass
            stored, seqs = [], []
            async for batch in events:
                seqs.append(batch.sequence_number)
                stored += [b for e in batch.events if e.WhichOneof("data") == "stored" for b in e.stored.blocks]
                if len(stored) >= 2:
                    break
            events.cancel()
            return stored, seqs

    stored, seqs = asyncio.run(asyncio.wait_for(run(), 60))
    assert [list(b.token_ids) for b in stored[:2]] == [prompt[:16], prompt[16:32]]
    assert seqs == sorted(seqs) and len(set(b.block_hash for b in stored)) == len(stored)
