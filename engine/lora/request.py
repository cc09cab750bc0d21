"""LoRARequest: which adapter a request runs with (vLLM's shape)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name (what clients ask for), a positive id unique per engine, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not self.lora_name:
            raise ValueError("lora_request.lora_name must not be empty.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
