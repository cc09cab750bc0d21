"""LoRAConfig: vLLM's multi-LoRA settings."""

import os
from dataclasses import dataclass

from engine.config.utils import check_choices, setting

# --lora-dtype's values (vLLM's): auto is the model's dtype.
LORA_DTYPES = ("auto", "bfloat16", "float16")


@dataclass
class LoRAConfig:
    """LoRA adapters (PEFT directories) served beside the base model, many in one batch: the adapters loaded at
    start, and the device slots' number, rank and dtype."""

    enable_lora: bool = setting(
        False, help="serve LoRA adapters (PEFT directories) beside the base model, many in one batch"
    )
    lora_modules: list[str] | None = setting(
        None, help="adapters loaded at start, as NAME=PATH (a PEFT directory) each; needs --enable-lora"
    )
    max_loras: int = setting(
        1, help="adapters in one batch at most: the device slots, each of --max-lora-rank, allocated at start"
    )
    max_lora_rank: int = setting(
        16, help="highest adapter rank served (the slots' size); an adapter of a higher rank is refused"
    )
    max_cpu_loras: int | None = setting(
        None,
        help="adapters kept in host memory (one evicted is read again from its directory); unset: --max-loras",
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        help="(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) let callers load and unload adapters while the engine runs "
        "(LoadLoraAdapter, UnloadLoraAdapter), from directories under --lora-root only; needs --enable-lora",
    )
    lora_root: str | None = setting(
        None,
        help="the directory adapters loaded at run time must be under, judged on the resolved path (a symlink "
        "out of it is refused); a relative lora_path is taken from here",
    )
    lora_dtype: str = setting(
        "auto",
        choices=LORA_DTYPES,
        help="dtype of the adapter slots (A and B): auto (the model's), bfloat16 or float16; the delta is "
        "accumulated in float32 whatever it is",
    )

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras}.")
        check_choices(self)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora).")
        self.get_lora_modules()  # checks the entries
        if self.allow_runtime_lora_updating and not self.enable_lora:
            raise ValueError("allow_runtime_lora_updating needs enable_lora (--enable-lora).")
        if self.allow_runtime_lora_updating and not self.lora_root:
            raise ValueError("allow_runtime_lora_updating needs lora_root, the directory adapters may be loaded from.")
        if self.lora_root is not None and not os.path.isdir(self.lora_root):
            raise ValueError(f"lora_root must be a directory, got {self.lora_root!r}.")

    def get_lora_modules(self) -> dict[str, str]:
        """--lora-modules as adapter name -> PEFT directory."""
        return parse_lora_modules(self.lora_modules)


def parse_lora_modules(entries: list[str] | None) -> dict[str, str]:
    """--lora-modules as adapter name -> PEFT directory."""
    modules = {}
    for entry in entries or []:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path or name in modules:
            raise ValueError(f"lora_modules entries must be distinct NAME=PATH, got {entry!r}.")
        modules[name] = path
    return modules


def runtime_lora_path(lora_root: str, lora_path: str) -> str:
    """A runtime load's adapter directory: lora_path (taken from lora_root when relative) resolved, symlinks and
    all, and refused unless it is lora_root or under it. The refusal names no path, and is the same whether or not
    the directory exists, so it tells a caller nothing of the server's files."""
    root = os.path.realpath(lora_root)
    resolved = os.path.realpath(os.path.join(root, lora_path))
    if os.path.commonpath([root, resolved]) != root or not os.path.isdir(resolved):
        raise ValueError("lora_path: no adapter directory of that name under --lora-root.")
    return resolved
