"""KV events in vLLM's wire format (--kv-events-config): a subscriber written from vLLM's published schema
(vllm/distributed/kv_events.py: msgspec structs, array-like and tagged; frames topic, sequence number, payload; a
ROUTER replay socket) receives the engine's BlockStored, BlockRemoved and AllBlocksCleared, with the engine's block
hashes in vLLM's integer form, and replays what it missed. A tiny random model, sockets on ipc:// in tmp_path."""

import json
import random
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from conftest import InProcessService, mesh_channel
from engine import LLM, SamplingParams
from engine.kv.hashing import extend_block_hashes
from llmmesh.v1 import engine_pb2, engine_pb2_grpc
from random_model import save_random_smollm2_shaped
from services import client
from test_models import COMMON

BLOCK = 16
BLOCK_BYTES = 2 * COMMON["num_hidden_layers"] * BLOCK * COMMON["num_key_value_heads"] * 16 * 4  # float32 K and V
TOPIC = b"kv@engine-0@tiny"


# ---- vLLM's schema, as a subscriber reads it --------------------------------------------------------------

# vllm/distributed/kv_events.py's event structs, their fields in order. array_like=True: a struct is an array of its
# fields; tag=True: the class name comes first. The fields with a default came later and may be missing from an
# older sender, so a reader counts only on the first REQUIRED.
SCHEMA = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip
REQUIRED = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}


def decode(payload: bytes) -> tuple[float, list[SimpleNamespace]]:
    """A KVEventBatch, [ts, events, data_parallel_rank]: its timestamp and events, each with `type` and its fields by
    name."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) in (2, 3), batch
    ts, events = batch[:2]
    assert batch[2:] in ([], [None]), batch  # one engine: no data-parallel rank
    decoded = []
    for event in events:
        assert isinstance(event, list) and event[0] in SCHEMA, event
        kind, values = event[0], event[1:]
        assert REQUIRED[kind] <= len(values) <= len(SCHEMA[kind]), event
        fields = dict.fromkeys(SCHEMA[kind]) | dict(zip(SCHEMA[kind], values))
        decoded.append(SimpleNamespace(type=kind, **fields))
    return ts, decoded


class Subscriber:
    """A SUB socket on the engine's endpoint, and a DEALER on its replay endpoint."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.replay_endpoint = replay_endpoint
        self.batches: list[tuple[int, bytes]] = []

    def receive(self, timeout: float = 0.5) -> list[tuple[int, bytes]]:
        """(sequence number, payload) of the batches that arrive until none has for `timeout` s."""
        got = []
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), payload))
        self.batches += got
        return got

    def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """(sequence number, payload) of every batch the engine kept from start_seq on."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))  # a REQ socket's envelope: empty, then the body
        replies = []
        while True:
            assert dealer.poll(10_000), "the replay did not end"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replies.append((int.from_bytes(seq, "big"), payload))
        dealer.close(linger=0)
        return replies

    def close(self) -> None:
        self.context.destroy(linger=0)


def events_of(batches, kind: str) -> list[SimpleNamespace]:
    return [e for _, payload in batches for e in decode(payload)[1] if e.type == kind]


def vllm_hash(block_hash: bytes) -> int:
    """vLLM's ExternalBlockHash with integer hashes (maybe_convert_block_hash): the digest's low 64 bits."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def prompt(seed: int, length: int = 2 * BLOCK + 5) -> list[int]:
    return random.Random(seed).choices(range(3, COMMON["vocab_size"]), k=length)


def wait_for_subscription(subscriber: Subscriber, publish) -> None:
    """PUB drops what it sends before a subscription reaches it: publish (an AllBlocksCleared) until one arrives."""
    deadline = time.monotonic() + 30
    while not subscriber.receive(0.1):
        assert time.monotonic() < deadline, "no KV event batch reached the subscriber"
        publish()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-events") / "model"
    save_random_smollm2_shaped(path, **COMMON)
    return path


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    """The offline LLM on an 8-block cache, publishing on ipc:// with a replay socket, and a subscriber."""
    sockets = tmp_path_factory.mktemp("sockets")
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{sockets}/events",
        "replay_endpoint": f"ipc://{sockets}/replay",
        "topic": TOPIC.decode(),
    }
    llm = LLM(model=str(model_dir), kv_cache_memory=str(8 * BLOCK_BYTES), kv_events_config=config)
    subscriber = Subscriber(config["endpoint"], config["replay_endpoint"])
    wait_for_subscription(subscriber, llm.reset_prefix_cache)
    yield llm, subscriber
    subscriber.close()
    llm.engine.shutdown()


def generate(llm, tokens: list[int]) -> None:
    llm.generate({"prompt_token_ids": tokens}, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)


def engine_hashes(llm, tokens: list[int]) -> list[int]:
    """The engine's own hashes of the prompt's full blocks (as it names them in its prefix cache), as vLLM sends
    them."""
    manager = llm.engine.kv_cache_manager
    hashes = extend_block_hashes([], tokens, BLOCK, manager.hash_fn, manager.root_hash, None)
    return [vllm_hash(h) for h in hashes]


def test_stored_removed_and_cleared_reach_a_subscriber_with_the_engines_hashes(engine):
    llm, subscriber = engine
    prompts = [prompt(seed) for seed in range(5)]
    first = len(subscriber.batches)
    for tokens in prompts:
        generate(llm, tokens)
    batches = subscriber.receive()
    # One batch per step with events, numbered on from the last one received.
    seqs = [seq for seq, _ in subscriber.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and len(batches) >= len(prompts)
    assert all(decode(payload)[0] > 0 for _, payload in batches)

    stored = events_of(batches, "BlockStored")
    assert len(stored) == len(prompts)  # each prompt's two full blocks, at its prefill
    for tokens, event in zip(prompts, stored):
        hashes = engine_hashes(llm, tokens)
        assert event.block_hashes == hashes and len(hashes) == 2
        assert event.parent_block_hash is None
        assert event.token_ids == tokens[: 2 * BLOCK]
        assert (event.block_size, event.medium, event.lora_id, event.lora_name) == (BLOCK, "GPU", None, None)
        assert event.extra_keys is None and event.group_idx == 0

    # 8 blocks and three a request: the first prompts' cached blocks are evicted for the later ones.
    removed = {h for e in events_of(batches, "BlockRemoved") for h in e.block_hashes}
    assert set(engine_hashes(llm, prompts[0])) <= removed
    assert all(e.medium == "GPU" for e in events_of(batches, "BlockRemoved"))
    assert removed <= {h for e in stored for h in e.block_hashes}

    # A prompt that shares the first block of a cached one: only its second block is new, with its parent's hash.
    last = prompts[-1]
    sharing = last[:BLOCK] + prompt(99, BLOCK + 5)
    generate(llm, sharing)
    (event,) = events_of(subscriber.receive(), "BlockStored")
    assert event.block_hashes == engine_hashes(llm, sharing)[1:]
    assert event.parent_block_hash == engine_hashes(llm, last)[0]
    assert event.token_ids == sharing[BLOCK : 2 * BLOCK]

    assert llm.reset_prefix_cache()
    ((_, payload),) = subscriber.receive()
    assert [e.type for e in decode(payload)[1]] == ["AllBlocksCleared"]
    assert len(subscriber.batches) > first


def test_a_replay_returns_the_batches_a_subscriber_missed(engine):
    llm, subscriber = engine
    generate(llm, prompt(10))
    subscriber.receive()
    seen = subscriber.batches[-1][0]
    # The subscriber is away for two prompts.
    missed = [prompt(11), prompt(12)]
    for tokens in missed:
        generate(llm, tokens)
    replayed = subscriber.replay(seen + 1)
    assert [seq for seq, _ in replayed] == list(range(seen + 1, seen + 1 + len(replayed)))
    stored = events_of(replayed, "BlockStored")
    assert [e.block_hashes for e in stored] == [engine_hashes(llm, tokens) for tokens in missed]
    # The same batches, byte for byte, as the PUB socket sent them; and a replay from an earlier number has more.
    assert subscriber.receive() == replayed
    assert [seq for seq, _ in subscriber.replay(seen)] == [seen, *(seq for seq, _ in replayed)]


def test_the_engine_service_publishes_with_the_flag(model_dir, tmp_path):
    """--kv-events-config on `llmmesh engine`: a Generate's blocks are published, from the engine thread's loop."""
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/events", "topic": TOPIC.decode()}
    flags = ["--model", model_dir, "--kv-cache-memory", str(8 * BLOCK_BYTES), "--kv-events-config", json.dumps(config)]
    sent = []
    with InProcessService("engine", [*flags, "--shutdown-timeout", "5"]) as service:
        channel = mesh_channel(service.address)
        stub = engine_pb2_grpc.EngineStub(channel)
        subscriber = Subscriber(config["endpoint"])
        params = client.sampling_params(temperature=0.0, max_tokens=2)

        def publish():  # a new prompt each time: a cached one stores nothing
            sent.append(prompt(100 + len(sent)))
            request = engine_pb2.EngineGenerateRequest(prompt_token_ids=sent[-1], sampling_params=params)
            list(stub.Generate(request, timeout=60))

        try:
            wait_for_subscription(subscriber, publish)
            stored = events_of(subscriber.batches + subscriber.receive(), "BlockStored")
        finally:
            subscriber.close()
            channel.close()
    assert stored and stored[-1].token_ids == sent[-1][: 2 * BLOCK]
    assert stored[-1].block_hashes and all(0 <= h < 2**64 for h in stored[-1].block_hashes)


@pytest.mark.parametrize(
    "config, words",
    [
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"enable_kv_cache_events": true, "endpoints": "tcp://*:5557"}', "unknown keys ['endpoints']"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be a positive integer"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(model_dir, config, words):
    with pytest.raises(ValueError, match="kv_events_config") as e:
        LLM(model=str(model_dir), kv_cache_memory=str(8 * BLOCK_BYTES), kv_events_config=config)
    assert words in str(e.value)
