"""The sampler as its own service (llmmesh.v1.Sampler): remote sampling gives exactly what in-process sampling
gives (token ids, logprobs, prompt logprobs, finish reasons), with the logits as bytes or in shared memory, also
under preemption and chunked prefill; the mesh with the sampler service gives LLM.generate's text; a sampler
killed, frozen or restarted (mid-read of a shared-memory slot too) costs the affected requests UNAVAILABLE, never
the engine, and a new stream gets new shared memory; the segment is private to its user and unlinked once both
ends have it; bad messages get INVALID_ARGUMENT naming the field."""

import os
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from test_mesh import expect_error, first_chunks, kill_while_streaming, wait_idle

from conftest import (
    SERVING,
    SMOLLM2_BLOCK_BYTES,
    InProcessService,
    assert_no_leaks,
    freeze,
    mesh_channel,
    wait_for_health,
    wait_until,
)
from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.request import Request
from engine.sample.sampler import LocalSampler, SamplerUnavailableError
from llmmesh.v1 import common_pb2, engine_pb2_grpc, sampler_pb2, sampler_pb2_grpc
from mesh.sampler.remote import RemoteSampler
from mesh.sampler.slots import SharedSlots
from mesh.sampler.wire import tensor_to_proto
from mesh.shared_memory import SHM_DIR
from services.client import collect, generate
from services.local_mesh import Mesh
from services.service_process import ServiceProcess
from test_models import COMMON

POEM = "Write a short poem about the sea, the wind, the gulls, the fishing boats coming home at dusk, " * 2
PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Three facts about the Moon:",
    "Once upon a time, in a small village,",
]
# Every sampling feature, several in one request; every random request has a seed (unseeded draws come from
# whichever process samples, so only seeded ones can match).
MIXED = [
    (POEM, dict(temperature=0, max_tokens=24, logprobs=5, prompt_logprobs=3)),  # 47 tokens: chunked prefill
    (PROMPTS[0], dict(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=24, n=3, logprobs=5)),
    (
        PROMPTS[1],
        dict(
            temperature=1.2,
            min_p=0.05,
            seed=2,
            max_tokens=24,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
        ),
    ),
    (
        PROMPTS[2],
        dict(
            temperature=0.9,
            top_p=0.8,
            seed=3,
            max_tokens=24,
            logit_bias={578: 4.0, 314: -5.0},
            bad_words=["the", "Moon"],
            min_tokens=12,
            prompt_logprobs=3,
        ),
    ),
    (PROMPTS[3], dict(temperature=0.7, seed=4, max_tokens=24, allowed_token_ids=list(range(200, 2000)))),
    (PROMPTS[0], dict(temperature=0, max_tokens=24, min_tokens=20, frequency_penalty=1.0, logprobs=2)),
]


@pytest.fixture(scope="module")
def sampler():
    with InProcessService("sampler") as service:
        yield service


def outputs(llm):
    llm.engine.reset_prefix_cache()  # the same scheduling for both runs
    before = llm.engine.get_stats().num_preemptions
    outs = llm.generate([p for p, _ in MIXED], [SamplingParams(**k) for _, k in MIXED], use_tqdm=False)
    assert_no_leaks(llm.engine)
    result = [
        (o.prompt_logprobs, [(c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in o.outputs])
        for o in outs
    ]
    return result, llm.engine.get_stats().num_preemptions - before


@pytest.mark.parametrize("shared_memory", [False, True], ids=["bytes", "shared-memory"])
def test_remote_sampling_equals_in_process_under_preemption_and_chunked_prefill(sampler, shared_memory):
    # 16 blocks of 16 tokens for 8 sequences that grow to 30-100 tokens: preemptions; 32-token steps: chunks.
    llm = LLM(kv_cache_memory=str(16 * SMOLLM2_BLOCK_BYTES), max_num_batched_tokens=32)
    runner = llm.engine.worker.model_runner
    local, local_preemptions = outputs(llm)
    slot_bytes = llm.engine.args.max_num_seqs * llm.engine.model_config.vocab_size * 4 if shared_memory else 0
    runner.sampler = RemoteSampler(sampler.address, slot_bytes=slot_bytes)
    try:
        remote, remote_preemptions = outputs(llm)
        assert (runner.sampler.slots is not None) == shared_memory  # the form the test names
    finally:
        runner.sampler.close()
    assert local_preemptions > 0 and remote_preemptions == local_preemptions
    assert remote == local
    # The batch really exercised what it claims to.
    n3 = local[1][1]
    assert len({tuple(c[0]) for c in n3}) > 1  # n=3 seeded: different samples
    assert len(local[0][0]) > 32 and local[3][0] is not None  # prompt logprobs over two 32-token chunks
    assert all(200 <= t < 2000 for t in local[4][1][0][0])
    assert len(local[5][1][0][0]) >= 20


def test_a_slot_holds_a_speculative_step_of_every_request(sampler, tiny_llama_dir):
    """With drafts a request samples 1 + num_speculative_tokens rows: the engine's slots hold max_num_seqs times
    that, so the largest verified step goes through shared memory too."""
    k, seqs, vocab = 3, 4, COMMON["vocab_size"]
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB", max_num_seqs=seqs, sampler_address=sampler.address,
              speculative_config=ngram)  # fmt: skip
    try:
        llm.generate("<5> <6> <7> <5> <6>", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        slots = llm.engine.worker.model_runner.sampler.slots
        assert slots is not None  # the service took the offer
        assert slots.write(torch.zeros(seqs * (1 + k), vocab)) is not None
        assert slots.write(torch.zeros(seqs * (1 + k) + 1, vocab)) is None  # one row more would go as bytes
    finally:
        llm.engine.shutdown()


def test_prompt_logprobs_split_over_several_messages(sampler, monkeypatch):
    """A prompt chunk larger than one message's worth goes in pieces, and joins back into the same logprobs."""
    import mesh.sampler.remote as remote

    llm = LLM(kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4, logprobs=1)
    local = llm.generate(POEM, params, use_tqdm=False)[0]
    monkeypatch.setattr(remote, "MESSAGE_TARGET_BYTES", 7 * llm.engine.model_config.vocab_size * 4)  # 7 rows
    llm.engine.worker.model_runner.sampler = client = RemoteSampler(sampler.address)
    try:
        out = llm.generate(POEM, params, use_tqdm=False)[0]
    finally:
        client.close()
    assert out.prompt_logprobs == local.prompt_logprobs
    assert out.outputs[0].token_ids == local.outputs[0].token_ids
    assert out.outputs[0].logprobs == local.outputs[0].logprobs


def test_fallback_samples_in_process_when_the_sampler_is_down():
    """--sampler-fallback: a sampler that does not answer costs nothing but the remote hop."""
    llm = LLM(kv_cache_memory="64MiB", sampler_address="127.0.0.1:1", sampler_fallback=True)  # nothing listens
    reference = LLM(kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, logprobs=2)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_lost_stream_names_the_seeded_requests_it_took_with_it():
    """The engine fails those too: after a sampler restart their draws could not match in-process sampling."""
    requests = [
        Request(name, [1, 2], SamplingParams(**params), (0,))
        for name, params in [
            ("seeded", dict(seed=1)),
            ("greedy", dict(temperature=0)),
            ("unseeded", {}),
            ("other", dict(seed=2)),
        ]
    ]
    service = InProcessService("sampler")
    client = RemoteSampler(service.address, timeout=30)
    try:
        out, _ = client.sample(requests, torch.zeros(4, 8), [])
        assert len(out.sampled_token_ids) == 4
        service.stop()
        with pytest.raises(SamplerUnavailableError) as info:
            client.sample(requests[1:3] + requests[3:], torch.zeros(3, 8), [])
        assert info.value.lost_request_ids == ["seeded"]  # "other" is in the failed step: failed anyway
    finally:
        client.close()
        service.stop()


# ---- shared memory -------------------------------------------------------------------------------


def heavy_step(rows=64, vocab=49152):
    """A step whose sampling takes a while (top-p sorts the whole vocabulary of every row, plus logprobs): long
    enough to catch the sampler in the middle of reading its slot."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, logprobs=5) for i in range(rows)]
    requests = [Request(f"r{i}", [1, 2], p, (0,)) for i, p in enumerate(params)]
    return requests, torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))


def reading(slots: SharedSlots, generation: int) -> bool:
    """The sampler has begun reading that generation's slot and not finished."""
    headers = [slots.header(i) for i in range(slots.num_slots)]  # (written, reading, done)
    return any(w == r == generation != d for w, r, d in headers)


def in_process(requests, logits, sampler=None):
    """What sampling in process gives (a fresh sampler: the requests' first step)."""
    out, _ = (sampler or LocalSampler(logits.device)).sample(requests, logits.clone(), [])
    return out.sampled_token_ids.tolist(), out.logprobs.logprobs.tolist()


def sample_with_retries(client, requests, logits, attempts=100):
    """The first calls after a restart may still find the port closed (the channel's reconnect backoff)."""
    for _ in range(attempts):
        try:
            out, _ = client.sample(requests, logits.clone(), [])
            return out.sampled_token_ids.tolist(), out.logprobs.logprobs.tolist()
        except SamplerUnavailableError:
            time.sleep(0.1)
    raise AssertionError(f"no answer after {attempts} attempts")


def segment_exists(slots: SharedSlots) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, slots.name))


def test_the_segment_is_private_and_unlinked_once_both_ends_have_it(sampler):
    slots = SharedSlots.create(num_slots=2, slot_bytes=4096)
    try:
        st = os.stat(os.path.join(SHM_DIR, slots.name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        # The sampler maps only a private segment, and only the one whose token it was given.
        os.chmod(os.path.join(SHM_DIR, slots.name), 0o640)
        with pytest.raises(ValueError, match="private"):
            SharedSlots.from_offer(slots.offer(), torch.device("cpu"))
        os.chmod(os.path.join(SHM_DIR, slots.name), 0o600)
        offer = slots.offer()
        offer.token = bytes(16)
        with pytest.raises(ValueError, match="token"):
            SharedSlots.from_offer(offer, torch.device("cpu"))
    finally:
        slots.close()
    assert not segment_exists(slots)

    requests, logits = heavy_step(rows=2, vocab=8)
    client = RemoteSampler(sampler.address, slot_bytes=logits.numel() * 4)
    try:
        assert sample_with_retries(client, requests, logits) == in_process(requests, logits)
        assert client.slots is not None and not segment_exists(client.slots)
    finally:
        client.close()


@pytest.mark.parametrize(
    "name", ["llmmesh-logits-" + "0" * 32, "../../etc/passwd", "llmmesh-logits-../../x"], ids=["absent", "path", "dots"]
)
def test_an_offer_the_sampler_cannot_map_keeps_the_bytes(sampler, name):
    """As from another host (no such segment here), or a name that is not a segment's: the answer is bytes, and
    the stream goes on with them."""
    offer = sampler_pb2.SharedMemoryOffer(name=name, num_slots=2, slot_bytes=4096, token=bytes(16))
    with mesh_channel(sampler.address) as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        first, second = stub.Sample(iter([step(shared_memory=offer), sampler_pb2.SampleStep(step_id=2, **GOOD)]))
    assert first.logits_form == sampler_pb2.LOGITS_FORM_BYTES
    assert list(second.sampled_token_ids) == [7]


def test_sampler_killed_mid_read_fails_the_step_at_once_and_a_restart_gets_fresh_memory():
    requests, logits = heavy_step()
    want = in_process(requests, logits)
    process = ServiceProcess("sampler", ["--port", "0"])
    client = RemoteSampler(process.wait_listening(120), timeout=60, slot_bytes=logits.numel() * 4)
    try:
        assert sample_with_retries(client, requests[:1], logits[:1]) == in_process(requests[:1], logits[:1])
        assert client.step_channel is not None  # the step waits on the channel, not on the stream
        old, generation = client.slots, client.slots.generation + 1
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.sample, requests[1:], logits[1:].clone(), [])
            wait_until(lambda: reading(old, generation), interval=0.001)
            process.popen.kill()
            with pytest.raises(SamplerUnavailableError) as info:
                future.result()
        # The stream broke: the step failed then, not after the 60 s deadline.
        assert "failed: UNAVAILABLE" in str(info.value)
        assert client.slots is None and not segment_exists(old)

        process = ServiceProcess("sampler", ["--port", str(process.port)])
        process.wait_listening(120)
        assert sample_with_retries(client, requests, logits) == want
        assert client.slots.name != old.name
    finally:
        client.close()
        process.stop()


def test_a_frozen_sampler_costs_the_deadline_and_its_slot_is_never_written_again():
    requests, logits = heavy_step()
    process = ServiceProcess("sampler", ["--port", "0"])
    client = RemoteSampler(process.wait_listening(120), timeout=2, slot_bytes=logits.numel() * 4)
    try:
        sample_with_retries(client, requests[:1], logits[:1])
        assert client.step_channel is not None
        old = client.slots
        buffer, generation = old.buffer, old.generation + 1  # the test's own mapping outlives the client's
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.sample, requests, logits.clone(), [])
            wait_until(lambda: reading(old, generation), interval=0.001)
            os.kill(process.popen.pid, signal.SIGSTOP)
            with pytest.raises(SamplerUnavailableError, match="did not answer within 2 s"):
                future.result()
        assert client.slots is None
        os.kill(process.popen.pid, signal.SIGCONT)
        # The sampler reads on to the end and finds its slot as it was: the engine did not write it again.
        view = SharedSlots(old.name, buffer, old.num_slots, old.slot_bytes, old.token)
        wait_until(lambda: any(view.header(i) == (generation,) * 3 for i in range(view.num_slots)), interval=0.001)
        # The engine goes on: a new stream on the same sampler, with new memory.
        assert sample_with_retries(client, requests, logits) == in_process(requests, logits)
        assert client.slots.name != old.name
    finally:
        client.close()
        process.stop()


def test_a_frozen_sampler_costs_a_greedy_step_the_deadline_and_its_slot_is_never_written_again():
    """The same for a greedy step (answered by the service's C++ loop): the engine gives up at the deadline, and
    the sampler, once it runs again, reads the slot to the end as the engine left it."""
    requests = [Request("g", [1, 2], SamplingParams(temperature=0), (0,))]
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(dim=-1).tolist()
    process = ServiceProcess("sampler", ["--port", "0"])
    client = RemoteSampler(process.wait_listening(120), timeout=2, slot_bytes=logits.numel() * 4)

    def tokens():
        for _ in range(100):  # the first calls after a start may still find the port closed
            try:
                out, _ = client.sample(requests, logits.clone(), [])
                return out.sampled_token_ids.tolist()
            except SamplerUnavailableError:
                time.sleep(0.1)
        raise AssertionError("no answer after 100 attempts")

    try:
        assert tokens() == want and client.num_greedy_steps == 1
        old = client.slots
        buffer, generation = old.buffer, old.generation + 1
        freeze(process.popen.pid)
        with pytest.raises(SamplerUnavailableError, match="did not answer within 2 s"):
            client.sample(requests, logits.clone(), [])
        assert client.slots is None and client.num_greedy_steps == 1
        os.kill(process.popen.pid, signal.SIGCONT)
        view = SharedSlots(old.name, buffer, old.num_slots, old.slot_bytes, old.token)
        wait_until(lambda: any(view.header(i) == (generation,) * 3 for i in range(view.num_slots)), interval=0.001)
        # A new stream with new memory, and greedy steps on it.
        assert tokens() == want
        assert client.slots.name != old.name and client.num_greedy_steps == 2
    finally:
        client.close()
        process.stop()


# ---- on a GPU: the logits stay on the device (CUDA IPC) ------------------------------------------


def gpu_sampler(device: str) -> ServiceProcess:
    """A sampler process (CUDA IPC is between processes) sampling on `device`."""
    return ServiceProcess("sampler", ["--port", "0", "--device", device])


@pytest.mark.gpu
def test_a_sampler_on_the_engines_gpu_samples_the_device_ring_in_place():
    requests, logits = heavy_step(rows=8)
    logits = logits.cuda()
    process = gpu_sampler("cuda")
    client = RemoteSampler(process.wait_listening(120), timeout=60, slot_bytes=logits.numel() * 4, device="cuda")
    try:
        local = LocalSampler(logits.device)
        for _ in range(3):  # the ring's slots in turn; the seeded generators go on from step to step
            assert sample_with_retries(client, requests, logits) == in_process(requests, logits, local)
        assert client.slots.form == sampler_pb2.LOGITS_FORM_CUDA_IPC and client.slots.device_ring.is_cuda
        assert client.slots.generation == 3 and not segment_exists(client.slots)
    finally:
        client.close()
        process.stop()


@pytest.mark.gpu
def test_a_sampler_on_the_cpu_takes_gpu_logits_as_bytes():
    requests, logits = heavy_step(rows=8)
    process = gpu_sampler("cpu")
    client = RemoteSampler(process.wait_listening(120), timeout=60, slot_bytes=logits.numel() * 4, device="cuda")
    try:
        assert sample_with_retries(client, requests, logits.cuda()) == in_process(requests, logits)
        assert client.slots is None
    finally:
        client.close()
        process.stop()


@pytest.mark.gpu
def test_remote_sampling_through_cuda_ipc_equals_in_process_under_preemption():
    llm = LLM(device="cuda", kv_cache_memory=str(16 * SMOLLM2_BLOCK_BYTES), max_num_batched_tokens=32)
    runner = llm.engine.worker.model_runner
    local, local_preemptions = outputs(llm)
    process = gpu_sampler("cuda")
    slot_bytes = llm.engine.args.max_num_seqs * llm.engine.model_config.vocab_size * 4
    runner.sampler = RemoteSampler(process.wait_listening(120), timeout=60, slot_bytes=slot_bytes, device="cuda")
    try:
        remote, remote_preemptions = outputs(llm)
        assert runner.sampler.slots.form == sampler_pb2.LOGITS_FORM_CUDA_IPC
    finally:
        runner.sampler.close()
        process.stop()
    assert local_preemptions > 0 and remote_preemptions == local_preemptions
    assert remote == local


# ---- bad messages ------------------------------------------------------------------------------


def step(**fields) -> sampler_pb2.SampleStep:
    return sampler_pb2.SampleStep(step_id=1, **fields)


def new_request(request_id="a", **params):
    return sampler_pb2.NewRequest(request_id=request_id, params=sampler_pb2.SamplerParams(**params))


GOOD = dict(
    new_requests=[new_request(temperature=0)],
    request_ids=["a"],
    num_new_tokens=[0],
    logits=tensor_to_proto(torch.arange(8, dtype=torch.float32).view(1, 8)),
)


SHARED = sampler_pb2.SharedLogits(slot=0, generation=1, dtype="float32", shape=[1, 8])


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(GOOD, logits=sampler_pb2.Tensor(dtype="float32", shape=[1, 8], data=b"\0" * 31)), "logits.data"),
        (dict(GOOD, logits=sampler_pb2.Tensor(dtype="int8", shape=[1, 8], data=b"\0" * 8)), "logits.dtype"),
        (dict(GOOD, logits=tensor_to_proto(torch.zeros(2, 8))), "logits.shape"),
        (dict(GOOD, new_requests=[], request_ids=["nobody"]), "request_ids[0]"),
        (dict(GOOD, num_new_tokens=[1]), "new_token_ids"),
        (dict(GOOD, num_new_tokens=[1], new_token_ids=[8]), "new_token_ids"),
        (
            dict(GOOD, new_requests=[new_request(temperature=0), new_request(temperature=0)]),
            "new_requests[1].request_id",
        ),
        (dict(GOOD, prompt_num_targets=[1], prompt_num_logprobs=[2], prompt_target_ids=[3]), "prompt_logits"),
        (dict(GOOD, shared_logits=SHARED), "shared_logits"),  # both forms at once
        ({k: v for k, v in GOOD.items() if k != "logits"} | {"shared_logits": SHARED}, "shared_logits"),  # no offer
    ],
)
def test_bad_messages_are_invalid_argument_naming_the_field(sampler, fields, named):
    with mesh_channel(sampler.address) as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Sample(iter([step(**fields)]), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert named in info.value.details()
        # The service is up and a good message on a new stream is answered.
        replies = list(stub.Sample(iter([step(**GOOD)]), timeout=30))
        assert [list(r.sampled_token_ids) for r in replies] == [[7]]
    wait_for_health(sampler.address, SERVING)


@pytest.mark.parametrize(
    "params, named",
    [
        (dict(temperature=-1), "new_requests[1].params.temperature"),
        (dict(temperature=1, logit_bias={99: 1.0}), "new_requests[1].params.logit_bias"),
        (
            dict(temperature=0, bad_words_token_ids=[common_pb2.TokenIds()]),
            "new_requests[1].params.bad_words_token_ids",
        ),
    ],
)
def test_a_request_with_bad_parameters_fails_its_row_alone(sampler, params, named):
    """The stream and the step's other rows go on; the row says why (its input), and the next step is served."""
    logits = tensor_to_proto(torch.arange(16, dtype=torch.float32).view(2, 8))
    first = step(
        new_requests=[new_request("a", temperature=0), new_request("b", **params)],
        request_ids=["a", "b"],
        num_new_tokens=[0, 0],
        logits=logits,
    )
    second = sampler_pb2.SampleStep(
        step_id=2,
        finished_request_ids=["b"],
        request_ids=["a"],
        num_new_tokens=[1],
        new_token_ids=[7],
        logits=tensor_to_proto(torch.arange(8.0).view(1, 8)),
    )
    with mesh_channel(sampler.address) as channel:
        replies = list(sampler_pb2_grpc.SamplerStub(channel).Sample(iter([first, second]), timeout=30))
    assert replies[0].sampled_token_ids[0] == 7
    [failed] = replies[0].failed
    assert failed.row == 1 and failed.invalid_input and named in failed.message
    assert list(replies[1].sampled_token_ids) == [7] and not replies[1].failed


def test_state_carries_across_steps_and_finished_requests_are_forgotten(sampler):
    vocab = 8
    logits = tensor_to_proto(torch.zeros(1, vocab))
    with mesh_channel(sampler.address) as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        messages = [
            # min_tokens=2 bans EOS (7) until two tokens are out; a repetition of token 3 is penalised.
            step(
                new_requests=[new_request(temperature=0, min_tokens=2, eos_token_ids=[7], frequency_penalty=2.0)],
                request_ids=["a"],
                num_new_tokens=[0],
                logits=tensor_to_proto(torch.tensor([[0, 0, 0, 1.0, 0, 0, 0, 5.0]])),
            ),
            sampler_pb2.SampleStep(
                step_id=2,
                request_ids=["a"],
                num_new_tokens=[1],
                new_token_ids=[3],
                logits=tensor_to_proto(torch.tensor([[0, 0, 0, 1.0, 0, 0, 0.5, 5.0]])),
            ),
            sampler_pb2.SampleStep(
                step_id=3,
                request_ids=["a"],
                num_new_tokens=[1],
                new_token_ids=[6],
                logits=tensor_to_proto(torch.tensor([[0, 0, 0, 1.0, 0, 0, 0.5, 5.0]])),
            ),
            sampler_pb2.SampleStep(
                step_id=4, finished_request_ids=["a"], request_ids=["a"], num_new_tokens=[0], logits=logits
            ),
        ]
        replies = []
        with pytest.raises(grpc.RpcError) as info:
            for reply in stub.Sample(iter(messages), timeout=30):
                replies.append(list(reply.sampled_token_ids))
        assert replies == [[3], [6], [7]]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_ids[0]" in info.value.details()


# ---- the mesh ------------------------------------------------------------------------------------


SAMPLER_TIMEOUT_S = 5.0
GREEDY = dict(temperature=0.0, max_tokens=16)
LONG = dict(temperature=0.0, max_tokens=1000, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh():
    m = Mesh(EngineArgs(kv_cache_memory="256MiB", sampler_timeout=SAMPLER_TIMEOUT_S), sampler=True)
    with m:
        yield m


@pytest.fixture(scope="module")
def engine(mesh):
    return engine_pb2_grpc.EngineStub(mesh_channel(mesh.services["engine"].address))


def until_served(mesh, prompt, params, attempts=50):
    """After a restart the engine's channel finds the sampler within its reconnect backoff (about a second):
    the first requests may still fail with UNAVAILABLE."""
    for _ in range(attempts):
        try:
            return collect(generate(mesh.address, prompt, **params))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            wait_for_health(mesh.services["sampler"].address, SERVING)
    raise AssertionError(f"the mesh did not serve after {attempts} attempts")


@pytest.mark.slow
def test_mesh_with_the_sampler_service_equals_llm_generate(mesh):
    llm = LLM(kv_cache_memory="256MiB")
    want = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    seeded = dict(temperature=0.8, seed=11, max_tokens=12, n=2)
    want_seeded = llm.generate(PROMPTS[0], SamplingParams(**seeded), use_tqdm=False)[0]
    for prompt, out in zip(PROMPTS, want):
        assert collect(generate(mesh.address, prompt, **GREEDY)).text() == out.outputs[0].text
    result = collect(generate(mesh.address, PROMPTS[0], **seeded))
    assert [result.text(i) for i in range(2)] == [c.text for c in want_seeded.outputs]


@pytest.mark.slow
def test_sampler_killed_then_restarted(mesh, engine):
    for details in kill_while_streaming(mesh, engine, "sampler"):  # UNAVAILABLE, their blocks freed
        assert "sampling failed: the sampler at" in details
    # While it is down: UNAVAILABLE at once; the engine goes on serving.
    assert "sampl" in expect_error(grpc.StatusCode.UNAVAILABLE, lambda: generate(mesh.address, PROMPTS[0], **GREEDY))
    wait_idle(engine)
    wait_for_health(mesh.services["engine"].address, SERVING)

    mesh.restart("sampler")
    want = LLM(kv_cache_memory="64MiB").generate(PROMPTS[1], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert until_served(mesh, PROMPTS[1], GREEDY).text() == want.outputs[0].text
    wait_idle(engine)


@pytest.mark.slow
def test_sampler_that_stops_answering_costs_a_deadline(mesh, engine):
    stream = generate(mesh.address, PROMPTS[2], **LONG)
    first_chunks(stream)
    sampler = mesh.services["sampler"]
    os.kill(sampler.popen.pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as info:
            collect(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert f"did not answer within {SAMPLER_TIMEOUT_S:g} s" in info.value.details()
        wait_idle(engine)
    finally:
        os.kill(sampler.popen.pid, signal.SIGCONT)
    assert until_served(mesh, PROMPTS[0], GREEDY).text()
    wait_idle(engine)


# What OMP_WAIT_POLICY and GOMP_SPINCOUNT hold when torch is first imported, in a process started as `llmmesh <argv>`.
POLICY_AT_TORCH_IMPORT = """
import builtins, os, sys
sys.argv = ["llmmesh", *sys.argv[1:]]
seen, real_import = [], builtins.__import__
def spy(name, *args, **kwargs):
    if name == "torch" and not seen:
        seen.append([os.environ.get(k, "unset") for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")])
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
import services.cli
import importlib
importlib.import_module(f"services.{sys.argv[1]}_service")  # what the command runs; torch loads here, not above
print(*seen[0])
"""


@pytest.mark.parametrize(
    ("argv", "env", "policy"),
    [
        ("sampler", {}, ["PASSIVE", "unset"]),
        ("sampler", {"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "unset"]),
        ("engine", {}, ["unset", "100000"]),
        ("engine", {"GOMP_SPINCOUNT": "300000"}, ["unset", "300000"]),
    ],
)
def test_the_sampler_sleeps_between_steps_from_its_start(argv, env, policy):
    """`llmmesh sampler` (as compose, serve and a hand start run it) has OpenMP's passive wait policy in force when
    torch loads, so its threads leave the cores to the engine between steps; `llmmesh engine` spins a shorter
    while than libgomp's default; a setting the user made wins."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = subprocess.run(
        [sys.executable, "-c", POLICY_AT_TORCH_IMPORT, argv],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.split() == policy
