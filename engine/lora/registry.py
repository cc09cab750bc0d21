"""LoRARegistry: the adapters one engine has loaded, by name, and the ids they go by.

vLLM keeps this map, and hands out adapter ids, in its serving layer; here the engine library owns it (EngineCore
keeps it current as adapters load and unload), so the offline LLM and every service see one registry. Requests are
resolved and checked against it in one place, the Processor.
"""

from collections.abc import Iterator, Mapping

from engine.lora.request import LoRARequest


class LoRARegistry(Mapping[str, LoRARequest]):
    """Adapter name -> its LoRARequest, for the adapters loaded now."""

    def __init__(self, enable_lora: bool):
        self.enable_lora = enable_lora
        self.loras: dict[str, LoRARequest] = {}
        # Adapter id -> the digest of its weights: its blocks' extra key in the prefix cache and the KV store.
        self.digests: dict[int, bytes] = {}

    def __getitem__(self, lora_name: str) -> LoRARequest:
        return self.loras[lora_name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.loras)

    def __len__(self) -> int:
        return len(self.loras)

    def new_request(self, lora_name: str, lora_path: str) -> LoRARequest:
        """A request for an adapter to load under the next free id (one above the highest loaded)."""
        return LoRARequest(lora_name, max(self.digests, default=0) + 1, lora_path)

    def find(self, lora_int_id_or_name: int | str) -> LoRARequest | None:
        return next((r for r in self.loras.values() if lora_int_id_or_name in (r.lora_int_id, r.lora_name)), None)

    def resolve(self, lora_name: str) -> LoRARequest | None:
        """A request's adapter by name (None for the base model); LookupError naming the loaded ones when unknown."""
        if not lora_name:
            return None
        lora = self.loras.get(lora_name)
        if lora is not None:
            return lora
        if not self.enable_lora:
            raise LookupError(
                f"lora_name {lora_name[:256]!r}: this engine serves no LoRA adapters (start it with --enable-lora)"
            )
        names = sorted(self.loras)
        loaded = ", ".join(names[:32]) + (" ..." if len(names) > 32 else "")
        raise LookupError(f"lora_name {lora_name[:256]!r}: no such LoRA adapter; loaded: {loaded or 'none'}")

    def check(self, lora_request: LoRARequest) -> None:
        """A request's adapter must be one loaded, under this name and id (ValueError: what is wrong)."""
        if not self.enable_lora:
            raise ValueError("lora_request: this engine serves no LoRA adapters (start it with --enable-lora).")
        loaded = self.loras.get(lora_request.lora_name)
        if loaded is None:
            names = ", ".join(sorted(self.loras)) or "none"
            raise ValueError(
                f"lora_request: unknown LoRA adapter {lora_request.lora_name!r}; loaded adapters: {names}."
            )
        if loaded != lora_request:
            raise ValueError(
                f"lora_request: adapter {lora_request.lora_name!r} is loaded as id {loaded.lora_int_id} from "
                f"{loaded.lora_path}, not as id {lora_request.lora_int_id} from {lora_request.lora_path}."
            )

    def check_new(self, lora_request: LoRARequest) -> bool:
        """Whether the adapter is still to load (False: it is loaded already); ValueError when it cannot be."""
        if not self.enable_lora:
            raise ValueError("LoRA adapters need an engine started with --enable-lora.")
        name, lora_int_id = lora_request.lora_name, lora_request.lora_int_id
        loaded = self.loras.get(name)
        if loaded == lora_request:
            return False
        if loaded is not None:
            raise ValueError(f"lora_request: an adapter named {name!r} is loaded already (id {loaded.lora_int_id}).")
        if lora_int_id in self.digests:
            raise ValueError(f"lora_request: lora_int_id {lora_int_id} is taken by another adapter.")
        return True

    def add(self, lora_request: LoRARequest, digest: bytes) -> None:
        self.loras[lora_request.lora_name] = lora_request
        self.digests[lora_request.lora_int_id] = digest

    def remove(self, lora_request: LoRARequest) -> None:
        del self.loras[lora_request.lora_name], self.digests[lora_request.lora_int_id]
