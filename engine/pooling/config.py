"""Which runner an engine is (vLLM's --runner) and, for a pooling one, how it pools (vLLM's PoolerConfig): from
--pooler-config, else the checkpoint's sentence-transformers files, else LAST with normalisation (vLLM's default
for an embedding model)."""

import json
from dataclasses import dataclass
from pathlib import Path

from engine.json_object import parse_json_object

RUNNER_TYPES = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")

# sentence-transformers' 1_Pooling/config.json modes the pooler implements, by the pooling type each is.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
# Modes it does not: refused when set.
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST_POOLING_MODULE = "sentence_transformers.models.Pooling"
_ST_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass
class PoolerConfig:
    """How a pooling engine turns a prompt's last hidden states into one vector."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}.")

    @property
    def needs_all_positions(self) -> bool:
        """Whether the pooling reads more than the prompt's last position: such requests skip prefix-cache hits."""
        return self.pooling_type != "LAST"

    @classmethod
    def resolve(cls, model_dir: Path, override: str | None, hidden_size: int) -> "PoolerConfig":
        """--pooler-config's fields over the checkpoint's own (sentence_transformers_config) over the defaults."""
        fields = sentence_transformers_config(model_dir, hidden_size) or {}
        if override:
            fields.update(parse_json_object(override, "pooler_config", ("pooling_type", "normalize")))
        return cls(**fields)


def sentence_transformers_config(model_dir: Path, hidden_size: int) -> dict | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json, its Pooling module's config.json, and
    a Normalize module after it); None when it has no Pooling module."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING_MODULE), None)
    config_file = Path(model_dir) / (pooling or {}).get("path", "") / "config.json"
    if pooling is None or not config_file.is_file():
        return None
    st = json.loads(config_file.read_text())
    where = f"{pooling['path']}/config.json"
    for mode in _ST_UNSUPPORTED_MODES:
        if st.get(mode):
            raise ValueError(f"{where}: {mode} is not implemented; supported: {', '.join(_ST_POOLING_MODES)}.")
    if st.get("include_prompt") is False:
        raise ValueError(f"{where}: include_prompt false is not implemented (every prompt token is pooled).")
    dim = st.get("word_embedding_dimension")
    if dim is not None and dim != hidden_size:
        raise ValueError(f"{where}: word_embedding_dimension {dim} differs from the model's hidden_size {hidden_size}.")
    modes = [t for mode, t in _ST_POOLING_MODES.items() if st.get(mode)]
    if len(modes) != 1:
        raise ValueError(f"{where}: exactly one of {', '.join(_ST_POOLING_MODES)} must be true, got {len(modes)}.")
    return {"pooling_type": modes[0], "normalize": any(m.get("type") == _ST_NORMALIZE_MODULE for m in modules)}


def resolve_runner(runner: str, has_lm_head: bool, model_dir: Path) -> str:
    """ "generate" or "pooling": auto is pooling for a base model without an LM head (Qwen3Model, LlamaModel...) or
    a sentence-transformers checkpoint, else generate. A model without an LM head cannot generate."""
    is_embedding = not has_lm_head or (Path(model_dir) / "modules.json").is_file()
    if runner == "auto":
        return "pooling" if is_embedding else "generate"
    if runner == "generate" and not has_lm_head:
        raise ValueError("runner generate needs an LM head, which this checkpoint (an embedding model) has not.")
    return runner


def get_pooler_config(
    runner: str, pooler_config: str | None, has_lm_head: bool, hidden_size: int, model_dir: Path
) -> PoolerConfig | None:
    """A pooling engine's PoolerConfig (--runner and --pooler-config over the checkpoint); None for a generating one."""
    if resolve_runner(runner, has_lm_head, model_dir) != "pooling":
        if pooler_config:
            raise ValueError(
                f"pooler_config is set ({pooler_config}), but the engine runs generate: set --runner pooling."
            )
        return None
    return PoolerConfig.resolve(model_dir, pooler_config, hidden_size)
