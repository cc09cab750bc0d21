"""The KV connector interface (vLLM's KVConnectorBase_V1) and its configuration (KVTransferConfig).

A connector moves KV blocks between the engine's paged cache and somewhere else. It has two halves,
one per role, as in vLLM: the scheduler side decides (how many prompt tokens can come from outside,
which blocks to store) and says so in a KVConnectorMetadata attached to each step; the worker side
does the copying (start_load_kv before the forward, wait_for_save after it) and reports what finished
(get_finished) in the step's KVConnectorOutput. Torch-free: the engine's config imports it.
"""

import enum
import json
from dataclasses import dataclass, field

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config: which connector, which role, and the connector's own options."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config must be a JSON object: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("kv_transfer_config must be a JSON object.")
        unknown = set(data) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
        if unknown:
            raise ValueError(
                f"kv_transfer_config has unknown keys {sorted(unknown)}; "
                "allowed: kv_connector, kv_role, kv_connector_extra_config."
            )
        config = cls(**data)
        from engine.kv.connector.factory import CONNECTORS  # noqa: PLC0415 (the registry imports this file)

        if config.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}, got {config.kv_connector!r}.")
        if config.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {list(KV_ROLES)}, got {config.kv_role!r}.")
        if not isinstance(config.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object.")
        return config

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step; each connector defines its own."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step: transfers that finished since the last report."""

    # load job id -> tokens that arrived (a multiple of the block size; fewer than asked after a fault)
    finished_recving: dict[int, int] = field(default_factory=dict)
    # store job id -> whether its blocks reached the store; either way the worker no longer reads them
    finished_sending: dict[int, bool] = field(default_factory=dict)
    # (bytes, seconds) of each finished load, for the load-or-recompute estimate
    load_timings: list[tuple[int, float]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.finished_recving or self.finished_sending)


class KVConnectorBase:
    """Both roles' methods; an instance serves one role."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole):
        self.config = config
        self.role = role

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local prefix hit that this connector can provide, and whether they load
        asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS)."""
        raise NotImplementedError

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Blocks are reserved for the external tokens: remember what to load into them."""
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's loads and stores; resets the connector's per-step state."""
        raise NotImplementedError

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report for a step (stores that no longer read their blocks, load timings)."""

    def abandon_stores(self) -> None:
        """The last step failed before its blocks were written: drop its stores."""

    def request_finished(self, request) -> None:
        """A request ended (finished, aborted or preempted-and-gone): drop what is kept for it."""

    def has_pending_transfers(self) -> bool:
        return False

    # ---- worker side ---------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's loads; they finish in the background."""
        raise NotImplementedError

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """After the forward: hand this step's stores to the background (returns without waiting)."""
        raise NotImplementedError

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        """Transfers that finished since the last call; waits up to wait_s for one when none has."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
