"""KVEventsConfig: vLLM's --kv-events-config, the KV cache's events published on a ZMQ socket for routers outside
the mesh (llm-d's precise prefix-cache scorer, Dynamo's KV router). Torch-free: the engine's config imports it."""

import json
from dataclasses import asdict, dataclass

from engine.json_object import parse_json_object

KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """vLLM's fields and defaults. publisher unset means "zmq" when events are on, as in vLLM."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"  # bound when it has a wildcard (or is ipc:// or inproc://), else connected to
    replay_endpoint: str | None = None  # a ROUTER socket answering "from sequence number N" with the batches kept
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self):
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv_events_config.enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}."
            )
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, got {self.publisher!r}."
            )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string, got {getattr(self, name)!r}.")
        if self.publisher == "zmq" and not self.endpoint:
            raise ValueError("kv_events_config.endpoint must be a ZMQ address, e.g. tcp://*:5557.")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str) or not self.replay_endpoint):
            raise ValueError(f"kv_events_config.replay_endpoint must be a ZMQ address, got {self.replay_endpoint!r}.")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}.")

    @property
    def publishes(self) -> bool:
        """Whether the engine opens the ZMQ sockets."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, value: "str | dict") -> "KVEventsConfig":
        text = value if isinstance(value, str) else json.dumps(value)
        fields = tuple(cls.__dataclass_fields__)
        return cls(**parse_json_object(text, "kv_events_config", fields))

    def to_dict(self) -> dict:
        return asdict(self)
