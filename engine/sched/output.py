"""What the scheduler hands to the model runner, and what a step hands back to callers."""

from dataclasses import dataclass, field

from engine.request import EngineCoreEvent, FinishReason, Request


@dataclass
class SchedulerOutput:
    # Running requests first, then the ones admitted this step, in batch order.
    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # KV block ids of each scheduled request (its block table row).
    block_ids: dict[str, list[int]]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests that finished since the previous step (so per-request state can be dropped).
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
