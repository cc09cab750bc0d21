"""The step channel (mesh/sampler/channel.py): with the logits in shared memory, each step's message and answer
go over a Unix socket the engine offers beside the slots. The same tokens and logprobs as over the stream and in
process; a sampler killed mid-step ends the step with UNAVAILABLE at once and the engine goes on; a socket the
sampler cannot use leaves the steps on the stream; a message the service refuses is INVALID_ARGUMENT naming the
field; the socket's name lives in an owner-only directory only until the service has connected. Greedy and sampled steps
(fixed frames the service answers in its C++ loop) give in-process sampling's tokens (a seeded row's draws too), leave
every other step to the protobuf, and fail as the protobuf's steps fail."""

import os
import random
import re
import stat
import struct
import time

import pytest
import torch

import mesh.sampler.remote as remote
from conftest import SERVING, InProcessService, freeze, mesh_channel, wait_for_health
from engine import LLM, SamplingParams
from engine.request import Request, StructuredOutputsParams
from engine.sample.metadata import GrammarBitmask
from engine.sample.sampler import LocalSampler, SamplerUnavailableError
from llmmesh.v1 import sampler_pb2, sampler_pb2_grpc
from mesh.sampler.channel import ChannelListener, connect
from mesh.sampler.remote import RemoteSampler
from mesh.sampler.slots import SharedSlots
from services.service_process import ServiceProcess
from test_models import COMMON

VOCAB = COMMON["vocab_size"]
PARAMS = [
    dict(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2),
    dict(temperature=0.9, top_p=0.9, seed=1, max_tokens=10, logprobs=1),
    dict(temperature=1.1, top_k=20, seed=2, max_tokens=12, repetition_penalty=1.2, frequency_penalty=0.3),
    dict(temperature=0.8, seed=3, max_tokens=9, min_tokens=5, ignore_eos=True),
]


@pytest.fixture(scope="module")
def sampler():
    with InProcessService("sampler") as service:
        yield service


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), kv_cache_memory="4MiB", max_num_seqs=8)


def generate(llm, sampler=None, kinds=PARAMS, num_requests=8):
    """Requests of every sampling kind: their tokens and logprobs, sampled by `sampler` (in process: None)."""
    runner = llm.engine.worker.model_runner
    local = runner.sampler
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": rng.choices(range(3, VOCAB), k=rng.randint(4, 40))} for _ in range(num_requests)]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(num_requests)]
    runner.sampler = sampler or local
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.sampler = local
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs]) for o in outs]


def client(address: str, step_channel: bool = True, timeout: float = 30.0) -> RemoteSampler:
    return RemoteSampler(address, timeout=timeout, slot_bytes=8 * VOCAB * 4, step_channel=step_channel)


def test_the_channel_gives_the_streams_tokens_and_logprobs(llm, sampler):
    want = generate(llm)
    for step_channel in (True, False):
        remote_sampler = client(sampler.address, step_channel)
        try:
            assert generate(llm, remote_sampler) == want
            assert remote_sampler.slots is not None  # the logits in shared memory either way
            assert (remote_sampler.step_channel is not None) == step_channel  # the steps where the test says
        finally:
            remote_sampler.close()
    assert any(lp is not None for lp, _ in want) and any(c[0][1] for _, c in want)  # logprobs were compared


# A greedy step's frame after its length (kernels/cpu/greedy_steps.cpp): step_id, generation, slot, dtype, rows, vocab.
GREEDY_STEP = struct.Struct("<QqIIII")
# Greedy rows that take the greedy step (one after its min_tokens), and rows that keep their batches on the protobuf.
GREEDY = [
    dict(temperature=0, max_tokens=24),
    dict(temperature=0, max_tokens=13, min_tokens=6),
    dict(temperature=0, max_tokens=19, stop_token_ids=[7, 9]),
    dict(temperature=0, max_tokens=11, repetition_penalty=1.3),
    dict(temperature=0.7, seed=5, max_tokens=8),
]


def test_greedy_steps_give_in_process_tokens_as_requests_come_and_go(llm, sampler):
    """Twelve requests on eight rows: batches with a penalized or sampled row go on the protobuf, batches of plain
    greedy rows as greedy steps, and the tokens are in-process sampling's."""
    want = generate(llm, kinds=GREEDY, num_requests=12)
    remote_sampler = client(sampler.address)
    try:
        assert generate(llm, remote_sampler, kinds=GREEDY, num_requests=12) == want
        assert remote_sampler.greedy_steps
        assert 0 < remote_sampler.num_greedy_steps < remote_sampler._step_id - 1  # both kinds of step ran
    finally:
        remote_sampler.close()


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(slot=2), "greedy step: slot must be in [0, 2), got 2"),
        (dict(generation=-1), "greedy step: generation -1 of slot"),
        (dict(dtype=3), "greedy step: dtype must be 0 (float32), 1 (bfloat16) or 2 (float16), got 3"),
        (dict(rows=0), "greedy step: rows and vocab must be at least 1"),
        (dict(rows=9), f"greedy step: 9 rows of {VOCAB} logits do not fit a slot of"),
        (dict(rows=2**31), "greedy step: rows must be at most"),
    ],
    ids=["slot", "generation", "dtype", "no-rows", "too-many-rows", "rows-over-the-limit"],
)
def test_a_greedy_step_the_service_refuses_is_invalid_argument_naming_the_field(sampler, fields, named):
    remote_sampler = client(sampler.address)
    try:
        requests = [Request("a", [1, 2], SamplingParams(temperature=0), (0,))]
        remote_sampler.sample(requests, torch.zeros(1, VOCAB), [])
        assert remote_sampler.num_greedy_steps == 1
        step = dict(step_id=99, generation=remote_sampler.slots.generation, slot=0, dtype=0, rows=1, vocab=VOCAB)
        step.update(fields)
        frame = GREEDY_STEP.pack(*step.values())
        remote_sampler.step_channel.sock.sendall(struct.pack("<I", 1 << 31 | len(frame)) + frame)
        with pytest.raises(SamplerUnavailableError, match=f"INVALID_ARGUMENT: {re.escape(named)}"):
            remote_sampler._stream_reply(30)
        remote_sampler.reset()
        # The service goes on: a new stream, and greedy steps on it.
        out, _ = remote_sampler.sample(requests, torch.arange(VOCAB, dtype=torch.float32).flip(0)[None], [])
        assert out.sampled_token_ids.tolist() == [0] and remote_sampler.num_greedy_steps == 2
    finally:
        remote_sampler.close()
    wait_for_health(sampler.address, SERVING)


def test_the_step_socket_is_private_and_gone_once_the_service_connected(sampler, monkeypatch):
    listener = ChannelListener()
    try:
        assert stat.S_IMODE(os.stat(listener.directory).st_mode) == 0o700
        assert os.stat(listener.directory).st_uid == os.getuid()
    finally:
        listener.close()
    assert not os.path.exists(listener.directory)

    made = []
    monkeypatch.setattr(remote, "ChannelListener", lambda: made.append(ChannelListener()) or made[-1])
    remote_sampler = client(sampler.address)
    try:
        requests = [Request("a", [1, 2], SamplingParams(temperature=0), (0,))]
        out, _ = remote_sampler.sample(requests, torch.arange(VOCAB, dtype=torch.float32)[None], [])
        assert out.sampled_token_ids.tolist() == [VOCAB - 1]
        assert remote_sampler.step_channel is not None and not os.path.exists(made[0].directory)
    finally:
        remote_sampler.close()


def public_directory() -> ChannelListener:
    listener = ChannelListener()
    os.chmod(listener.directory, 0o755)
    return listener


@pytest.mark.parametrize(
    "path", ["/tmp/llmmesh-step-abcdefgh/../step", "/tmp/other/step", "/nowhere/llmmesh-step-abcdefgh/step"]
)
def test_the_service_connects_only_to_an_engines_private_step_socket(path):
    with pytest.raises((ValueError, OSError)):
        connect(path, bytes(16))
    listener = public_directory()
    try:
        with pytest.raises(ValueError, match="private"):
            connect(listener.path, bytes(16))
    finally:
        listener.close()


def test_a_step_socket_the_service_cannot_use_leaves_the_steps_on_the_stream(sampler, monkeypatch):
    """As for a service in another mount namespace, or a directory others could enter: the slots are taken, the
    channel is not, and the steps go over the stream with the same results."""
    monkeypatch.setattr(remote, "ChannelListener", public_directory)
    want = generate_steps(LocalSampler(torch.device("cpu")))
    remote_sampler = client(sampler.address)
    try:
        assert generate_steps(remote_sampler) == want
        assert remote_sampler.slots is not None and remote_sampler.step_channel is None
    finally:
        remote_sampler.close()


def generate_steps(batch_sampler, steps=3):
    """A few steps of four seeded requests on fixed logits: each step's tokens and logprobs."""
    requests = [Request(f"r{i}", [1, 2], SamplingParams(temperature=1.0, seed=i, logprobs=2), (0,)) for i in range(4)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    got = []
    for _ in range(steps):
        out, _ = batch_sampler.sample(requests, logits.clone(), [])
        got.append((out.sampled_token_ids.tolist(), out.logprobs.logprobs.tolist()))
        for request, token in zip(requests, out.sampled_token_ids.tolist()):
            request.append_output_token_ids(token)
    return got


def test_a_message_the_service_refuses_is_invalid_argument_naming_the_field(sampler):
    remote_sampler = client(sampler.address)
    try:
        generate_steps(remote_sampler, steps=1)
        assert remote_sampler.step_channel is not None
        bad = sampler_pb2.SampleStep(step_id=99, request_ids=["nobody"], num_new_tokens=[0])
        with pytest.raises(SamplerUnavailableError, match="INVALID_ARGUMENT: logits.dtype must be one of"):
            remote_sampler._exchange(bad, None, None)
        remote_sampler.reset()
        # A length over the limit is refused before anything is read for it.
        generate_steps(remote_sampler, steps=1)
        remote_sampler.step_channel.sock.sendall(struct.pack("<I", 2**30 - 1))  # bits 30 and 31 name fixed frames
        with pytest.raises(SamplerUnavailableError, match="INVALID_ARGUMENT: step channel: .*message length"):
            remote_sampler._stream_reply(30)
        remote_sampler.reset()
        # The service goes on: a new stream, a new channel.
        assert generate_steps(remote_sampler) == generate_steps(LocalSampler(torch.device("cpu")))
        assert remote_sampler.step_channel is not None
    finally:
        remote_sampler.close()
    wait_for_health(sampler.address, SERVING)


@pytest.mark.parametrize("greedy", [False, True], ids=["protobuf-step", "greedy-step"])
def test_a_sampler_killed_mid_step_ends_it_with_unavailable_and_the_engine_goes_on(llm, greedy):
    """The engine's wait on the channel ends at the sampler's death, not at the deadline; the next steps, on a
    restarted sampler, get a new stream, new slots and a new channel."""
    process = ServiceProcess("sampler", ["--port", "0"])
    remote_sampler = client(process.wait_listening(120), timeout=300)
    try:
        generate_steps(remote_sampler, steps=1)
        old_channel = remote_sampler.step_channel
        assert old_channel is not None
        params = SamplingParams(temperature=0) if greedy else SamplingParams(temperature=0, logprobs=1)
        requests = [Request("k", [1, 2], params, (0,))]
        freeze(process.popen.pid)  # the step reaches a sampler that cannot answer it

        def kill():
            process.popen.kill()

        with pytest.raises(SamplerUnavailableError, match="failed: UNAVAILABLE"):
            remote_sampler.sample(requests, torch.zeros(1, VOCAB), [], while_waiting=kill)
        assert remote_sampler.step_channel is None and remote_sampler.slots is None
        assert remote_sampler.num_greedy_steps == 0  # the killed step was the greedy one, and was not answered

        process = ServiceProcess("sampler", ["--port", str(process.port)])
        process.wait_listening(120)
        want = generate_steps(LocalSampler(torch.device("cpu")))
        for _ in range(100):  # the gRPC channel's reconnect backoff
            try:
                got = generate_steps(remote_sampler)
                break
            except SamplerUnavailableError:
                time.sleep(0.1)
        assert got == want
        assert remote_sampler.step_channel not in (None, old_channel)
        assert generate(llm, remote_sampler) == generate(llm)
    finally:
        remote_sampler.close()
        process.stop()


def test_the_raw_stream_refuses_a_step_socket_it_cannot_reach(sampler):
    """The offer's answer over the stream itself: shared memory taken, no channel, and the next step on the
    stream is served."""
    slots = SharedSlots.create(num_slots=2, slot_bytes=4096)
    try:
        offer = slots.offer()
        offer.step_socket = "/nowhere/llmmesh-step-abcdefgh/step"
        logits = torch.arange(8, dtype=torch.float32)[None]
        first = sampler_pb2.SampleStep(step_id=1, shared_memory=offer)
        new = sampler_pb2.NewRequest(request_id="a", params=sampler_pb2.SamplerParams(temperature=0))
        second = sampler_pb2.SampleStep(step_id=2, new_requests=[new], request_ids=["a"], num_new_tokens=[0])

        def messages():
            yield first
            slot, generation = slots.write(logits)
            second.shared_logits.CopyFrom(
                sampler_pb2.SharedLogits(slot=slot, generation=generation, dtype="float32", shape=[1, 8])
            )
            yield second

        with mesh_channel(sampler.address) as channel:
            replies = list(sampler_pb2_grpc.SamplerStub(channel).Sample(messages(), timeout=30))
    finally:
        slots.close()
    assert replies[0].logits_form == sampler_pb2.LOGITS_FORM_SHARED_MEMORY and not replies[0].step_channel
    assert list(replies[1].sampled_token_ids) == [7]


# Rows a sampled step takes: greedy beside them, temperature, top-k, top-k with top-p, top-p alone, min-p.
PLAIN = [
    dict(temperature=0),
    dict(temperature=0.8),
    dict(temperature=1.0),
    dict(temperature=1.1, top_k=20),
    dict(temperature=0.7, top_k=50, top_p=0.8),
    dict(temperature=0.9, top_p=0.9),
    dict(temperature=1.0, top_p=0.3),
    dict(temperature=0.6, min_p=0.05, top_p=0.95),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [VOCAB, 4099])  # 4099: top-p's partial topk path, past 4 * 256 tokens
def test_sampled_rows_are_the_samplers_seeded_draws(dtype, vocab):
    """The C++ sampled step draws what the Sampler draws: seeded rows (and the greedy row) token for token, batch by
    batch of every mix of the settings, with flat and peaked logits."""
    kernels = pytest.importorskip("kernels.cpu_ops").try_load()
    if kernels is None:
        pytest.skip("no CPU kernels")
    from engine.sample.metadata import SamplingMetadata
    from engine.sample.ops import seeded_generators
    from engine.sample.sampler import Sampler

    rng = random.Random(1)
    for trial in range(24):
        kinds = rng.sample(PLAIN, rng.randint(1, len(PLAIN)))
        requests = [
            Request(f"r{i}", [1], SamplingParams(**k, seed=rng.randrange(2**40)), (0,)) for i, k in enumerate(kinds)
        ]
        for request in requests:
            for _ in range(rng.randrange(4)):
                request.append_output_token_ids(rng.randrange(vocab))
        scale = 1.0 if trial % 2 else 8.0  # flat, then peaked: top-p's nucleus small and large
        logits = (scale * torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(trial))).to(dtype)
        generators = seeded_generators(requests, {}, torch.device("cpu"))
        md = SamplingMetadata.from_requests(requests, generators, vocab, torch.device("cpu"))
        want = Sampler()(logits.clone(), md).sampled_token_ids.tolist()
        rows = b"".join(
            remote._plain_row(r.sampling_params) + remote._INDEX.pack(len(r.output_token_ids)) for r in requests
        )
        assert kernels.sample_plain_rows(logits.clone(), rows).tolist() == want, kinds


def test_sampled_steps_give_in_process_tokens_as_requests_come_and_go(llm, sampler):
    """Twelve seeded requests of every plain kind and n=1 on eight rows: steps of plain rows go as sampled steps,
    those with a penalized or logprob row on the protobuf, and the tokens are in-process sampling's."""
    kinds = [dict(k, seed=i, max_tokens=8 + i) for i, k in enumerate(PLAIN)] + GREEDY[3:]
    want = generate(llm, kinds=kinds, num_requests=12)
    remote_sampler = client(sampler.address)
    try:
        assert generate(llm, remote_sampler, kinds=kinds, num_requests=12) == want
        assert 0 < remote_sampler.num_sampled_steps < remote_sampler._step_id - 1  # both kinds of step ran
    finally:
        remote_sampler.close()


NAN_ROW = remote.PLAIN_ROW.pack(float("nan"), 1.0, 0.0, -1, 0, 0) + remote._INDEX.pack(0)


@pytest.mark.parametrize(
    "row, named",
    [
        (NAN_ROW, "sampled step: row 0: temperature must be a positive number"),
        (NAN_ROW[:-1], "sampled step: a frame of 71 bytes; the step has 32, then 40 for each row"),
    ],
    ids=["bad-temperature", "part-of-a-row"],
)
def test_a_sampled_step_the_service_refuses_is_invalid_argument_naming_the_field(sampler, row, named):
    remote_sampler = client(sampler.address)
    try:
        requests = [Request("a", [1, 2], SamplingParams(temperature=0.5, seed=3), (0,))]
        remote_sampler.sample(requests, torch.zeros(1, VOCAB), [])
        assert remote_sampler.num_sampled_steps == 1
        frame = GREEDY_STEP.pack(99, remote_sampler.slots.generation, 0, 0, 1, VOCAB) + row
        remote_sampler.step_channel.sock.sendall(struct.pack("<I", 1 << 30 | len(frame)) + frame)
        with pytest.raises(SamplerUnavailableError, match=f"INVALID_ARGUMENT: {re.escape(named)}"):
            remote_sampler._stream_reply(30)
        remote_sampler.reset()
        out, _ = remote_sampler.sample(requests, torch.zeros(1, VOCAB), [])
        assert remote_sampler.num_sampled_steps == 2
    finally:
        remote_sampler.close()
    wait_for_health(sampler.address, SERVING)


# Rows a sampled step cannot take: each changes a logit or asks for more than a token (min_tokens until reached).
NOT_PLAIN = {
    "logprobs": dict(logprobs=2),
    "presence": dict(presence_penalty=0.5),
    "frequency": dict(frequency_penalty=0.5),
    "repetition": dict(repetition_penalty=1.3),
    "logit-bias": dict(logit_bias={5: 4.0}),
    "bad-words": dict(bad_words=["x"]),
    "allowed": dict(allowed_token_ids=[3, 4, 5, 6]),
    "min-tokens": dict(min_tokens=5),
    "structured": dict(structured_outputs=StructuredOutputsParams(regex="a+")),
}


@pytest.mark.parametrize("kind", NOT_PLAIN)
def test_a_row_a_sampled_step_cannot_take_sends_its_steps_the_long_way(sampler, kind):
    """A plain seeded row beside one that is not: every step goes as a protobuf, no greedy or sampled step, and
    the tokens (and logprobs) are in-process sampling's; the plain row alone then goes as a sampled step."""
    params = SamplingParams(temperature=0.8, seed=2, **NOT_PLAIN[kind])
    if kind == "bad-words":
        params.bad_words_token_ids = [[9, 5]]  # 5 is banned after a 9
    requests = [
        Request("plain", [1, 2], SamplingParams(temperature=0.8, seed=1), (0,)),
        Request("other", [1, 2, 9], params, (0,)),
    ]
    # The structured row's grammar allows tokens 4 to 7 alone.
    grammar = None
    if kind == "structured":
        bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
        bitmask[0, 0] = 0b11110000
        grammar = GrammarBitmask([1], bitmask)
    local, remote_sampler = LocalSampler(torch.device("cpu")), client(sampler.address)
    try:
        for step in range(4):
            logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(step))
            want, _ = local.sample(requests, logits.clone(), [], grammar)
            got, _ = remote_sampler.sample(requests, logits.clone(), [], grammar)
            assert got.sampled_token_ids.tolist() == want.sampled_token_ids.tolist()
            assert (got.logprobs is None) == (want.logprobs is None)
            if want.logprobs is not None:
                assert got.logprobs.token_ids.tolist() == want.logprobs.token_ids.tolist()
                assert torch.allclose(got.logprobs.logprobs, want.logprobs.logprobs)
            for request, token in zip(requests, want.sampled_token_ids.tolist()):
                request.append_output_token_ids(token)
        assert remote_sampler.num_sampled_steps == remote_sampler.num_greedy_steps == 0
        remote_sampler.sample(requests[:1], torch.zeros(1, VOCAB), [])
        assert remote_sampler.num_sampled_steps == 1
    finally:
        remote_sampler.close()
