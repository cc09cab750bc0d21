"""Quantization methods: the only code that knows a layer's weight format (vLLM's QuantizeMethodBase).

A Linear or VocabParallelEmbedding owns no weights of its own: its method creates the parameters a checkpoint
fills (create_weights), turns them into what its kernel reads once they are loaded
(process_weights_after_loading), and computes with them (apply). Wrapping a layer (LoRA) or sharding it
(tensor parallelism) goes through the same three calls.

Methods (--quantization):
- unset: the checkpoint's float weights (UnquantizedLinearMethod).
- int8: weight-only, symmetric int8 codes with one scale per output row, quantized at the first load and cached.
- int4: weight-only, asymmetric 4-bit codes in groups of 32 along the input, quantized at the first load and cached.
- gguf: a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors as stored (group-wise codes, kernels/quant.py's format);
  its other tensor types arrive dequantized to float32. A GGUF model gets it by default.

On CPU with AVX512-VNNI or AVX2, bfloat16 codes in groups of 32 (int4, GGUF's Q4_0, Q4_1 and Q8_0) run on
kernels.quant's int8_dot_linear, activations rounded to int8 per block of 32 (a step's few rows where oneDNN takes
bfloat16, every step where it does not). Otherwise the int8 and int4
kernels (and ours for GGUF's Q8_0 and Q6_K groups, kernels.quant.group_gemv) compute
in bfloat16 or float16 and pay off for a decode step's few rows; oneDNN on the dequantized weight is faster for
more rows (docs/benchmarks.md), so a quantized layer keeps that too. A GGUF model in float32 runs the dequantized
weights alone: the same values the file's dequantizer gives, on float32's fastest kernel.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import UninitializedParameter

from kernels.dense import dense_codes_kernel, dense_kernel, pack_codes, packed_view
from kernels.quant import (
    dequantize,
    group_gemv_kernel,
    int4_linear,
    int4_scales_and_zeros,
    int8_dot_kernel,
    int8_dot_takes,
    int8_linear,
    is_int4,
    is_int8_per_row,
    pack_int4,
    pack_int8_dot,
    quantize_int4,
    quantize_int8,
)

INT4_GROUP_SIZE = 32
# Most rows a CPU step runs on the int4/int8 kernels; above it oneDNN on the dequantized weight is faster.
CPU_KERNEL_MAX_ROWS = 4
# Most rows a float32 CPU step runs codes on dense_codes_linear (kernels/dense.py): 4-bit codes and their float16
# scales are about a sixth of the float32 weight's bytes, and each weight formed serves up to 4 rows. On an EPYC Zen 3
# (AVX2) SmolLM2's 120 products as 4-bit codes took 0.32-0.34 / 0.34-0.40 / 0.51-0.57 / 0.68-0.95 / 1.1-1.2 of
# dense_linear's time at 1 / 2 / 4 / 8 / 16 rows.
CODES_MAX_ROWS = 8
# The same for int8_dot_linear, by its packed group's bytes: 4-bit codes (320) or 8-bit (576), each where it stops
# beating oneDNN (AVX512-VNNI, docs/benchmarks.md). Where oneDNN takes no bfloat16 (a CPU without AVX-512) the rest
# run on F.linear, which it beats at every row count: on an EPYC Zen 3 (AVX2), 0.07-0.41 of its time from 1 to 512
# rows on SmolLM2-135M's shapes, so there it runs every step.
INT8_DOT_MAX_ROWS = {320: 16, 576: 6}
_QUANTIZED_ACT_DTYPES = (torch.bfloat16, torch.float16)
# Most rows a CPU step runs on kernels.dense's dense_linear, by dtype and the packed tile's columns (oneDNN's layout
# on this CPU, tiles of 32 where it uses AMX): past them oneDNN's own kernel on the same packed weight, or the
# engine's whole decode step, gains no more (docs/benchmarks.md). On AVX2 (float32 only) oneDNN's kernel is slower
# for longer: it reaches dense_linear's rate at about 128 rows.
if torch.backends.cpu.get_cpu_capability() == "AVX2":
    DENSE_MAX_ROWS = {(torch.float32, 64): 128}
else:
    DENSE_MAX_ROWS = {(torch.bfloat16, 32): 8, (torch.bfloat16, 64): 16, (torch.float32, 64): 64}
# Batch invariance (--batch-invariant on, docs/determinism.md): a layer computes every row by one kernel, whatever the
# step's row count, so a row's output never depends on its neighbours. Codes int8_dot_linear takes run on it for every
# M (one reduction order along K, and at prefill sizes about as fast as oneDNN on the dequantized weight: the
# weight's bytes are a quarter, the products integer); other weights run dense_linear for every M, whose order along
# K does not depend on M either, unless oneDNN's float32 product gives dense_linear's bits on the layer's shape
# (checked at load: oneDNN's AVX2 kernel sums K as dense_linear's AVX2 form does), when each M takes the faster of
# the two as with invariance off. Off: each M on its fastest kernel, as the tables above say.


class QuantizeMethodBase:
    """How one layer holds and uses its weight; one instance may serve many layers (state lives on the layer)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Turn the loaded parameters into what apply() reads, in the compute dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LinearMethodBase(QuantizeMethodBase):
    pass


def _onednn_supports(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _register(layer: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    layer.register_parameter(name, None if tensor is None else nn.Parameter(tensor, requires_grad=False))


class UnquantizedLinearMethod(LinearMethodBase):
    """Float weights. On CPU the matmul goes through oneDNN with the weight packed once, after loading:
    faster than F.linear's MKL sgemm on this model's shapes (vLLM's CPU backend does the same,
    `dispatch_cpu_unquantized_gemm`). On a GPU, or where oneDNN cannot take the dtype, F.linear.
    In bfloat16 on a CPU with AVX512-BF16, or float32 with AVX-512 or AVX2, a step of up to DENSE_MAX_ROWS rows runs
    kernels.dense's dense_linear on oneDNN's packed weight itself (no second copy): it reads the weight near the
    memory's rate, which a decode step's few rows are bound by (docs/benchmarks.md)."""

    def create_weights(self, layer, input_size, output_size):
        _register(layer, "weight", torch.empty(output_size, input_size))
        layer.packed = layer.packed_dense = None  # plain F.linear until the weight is loaded and packed

    def process_weights_after_loading(self, layer, dtype):
        layer.packed = layer.packed_dense = None
        layer.dense_every_m = False  # True: batch invariance needs dense_linear for every row count
        if _onednn_supports(layer.weight.device, dtype):
            weight = layer.weight.detach().to(dtype)
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if dense_kernel(dtype) is not None:
                layer.packed_dense = packed_view(layer.packed, weight)
            if layer.packed_dense is not None and getattr(layer, "batch_invariant", False):
                layer.dense_every_m = not _onednn_sums_as_dense(layer, weight.shape)
            layer.weight = None  # a tied embedding keeps its own reference
        else:
            layer.weight.data = layer.weight.data.to(dtype)

    def apply(self, layer, x):
        if layer.packed is None:
            return F.linear(x, layer.weight, layer.bias)
        dense = layer.packed_dense
        if (
            dense is not None
            and x.dim() == 2
            and (layer.dense_every_m or x.shape[0] <= DENSE_MAX_ROWS.get((x.dtype, dense.shape[2]), 0))
        ):
            return torch.ops.llmmesh_dense.dense_linear(x, dense, layer.output_size, layer.bias)
        return _onednn_linear(x, layer.packed, layer.bias)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_SUMS_AS_DENSE: dict[tuple, bool] = {}


def _onednn_sums_as_dense(layer: nn.Module, shape: torch.Size) -> bool:
    """Whether oneDNN's product gives dense_linear's bits, row for row, on the layer's shape, at a step just past
    dense_linear's rows and at four times that. Float32 only (bfloat16 with AMX sums in tiles of its own). Once a
    shape and bias: the order of the sums is the kernels' choice for the shape and the threads, not the weight's."""
    view, (n, k) = layer.packed_dense, shape
    if view.dtype != torch.float32:
        return False
    bias = None if layer.bias is None else layer.bias.detach().float()
    key = (n, k, bias is not None, torch.get_num_threads())
    if key not in _SUMS_AS_DENSE:
        rows = DENSE_MAX_ROWS.get((torch.float32, view.shape[2]), 0) + 1
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(m, k, generator=gen) for m in (rows, 4 * rows)]
        _SUMS_AS_DENSE[key] = all(
            torch.equal(torch.ops.llmmesh_dense.dense_linear(x, view, n, bias), _onednn_linear(x, layer.packed, bias))
            for x in xs
        )
    return _SUMS_AS_DENSE[key]


class GroupQuantLinearMethod(LinearMethodBase):
    """Group-wise codes, scales and zeros (kernels/quant.py): int8_dot_linear in bfloat16, dense_codes_linear in
    float32 (AVX2), PyTorch's int4 or int8 kernel, else our group kernel on CPU, for a step's few rows; the
    dequantized weight through UnquantizedLinearMethod for the rest."""

    dense = UnquantizedLinearMethod()

    def process_codes(self, layer, q, scales, zeros, dtype) -> None:
        layer.kernel, layer.kernel_max_rows = None, CPU_KERNEL_MAX_ROWS if q.device.type == "cpu" else None
        dot = int8_dot_kernel() if dtype == torch.bfloat16 and q.device.type == "cpu" else None
        packed = pack_int8_dot(q, scales, zeros) if dot is not None and int8_dot_takes(q, scales) else None
        invariant = getattr(layer, "batch_invariant", False)
        codes = None  # float32 codes for dense_codes_linear, which runs once the dequantized weight is there to check
        if packed is not None:
            layer.kernel = lambda x: dot(x, *packed)
            bounded = not invariant and _onednn_supports(q.device, dtype)
            layer.kernel_max_rows = INT8_DOT_MAX_ROWS[packed[0].shape[2]] if bounded else None
        elif dtype == torch.float32 and q.device.type == "cpu" and (codes_kernel := dense_codes_kernel()) is not None:
            codes = pack_codes(q, scales, zeros)
        elif invariant and q.device.type == "cpu":
            pass  # the dequantized weight alone, on one kernel for every M
        elif dtype in _QUANTIZED_ACT_DTYPES and is_int4(q, scales):
            group_size = q.shape[1] // scales.shape[1]
            packed, sz = pack_int4(q, q.device), int4_scales_and_zeros(scales, zeros, dtype)
            layer.kernel = lambda x: int4_linear(x, packed, group_size, sz)
        elif dtype in _QUANTIZED_ACT_DTYPES and is_int8_per_row(q, scales, zeros) and q.device.type == "cpu":
            row_scales = scales[:, 0].to(dtype)
            layer.kernel = lambda x: int8_linear(x, q, row_scales)
        elif dtype in _QUANTIZED_ACT_DTYPES and q.device.type == "cpu" and q.shape[1] // scales.shape[1] in (16, 32):
            gemv = group_gemv_kernel()
            if gemv is not None:
                q, scales, zeros = q.contiguous(), scales.float().contiguous(), zeros.float().contiguous()
                # Its time grows with the rows: on the output layer's shape it beat oneDNN at one row only.
                layer.kernel, layer.kernel_max_rows = (lambda x: gemv(x, q, scales, zeros)), 1
        if layer.kernel is None or layer.kernel_max_rows is not None:
            _register(layer, "weight", dequantize(q, scales, zeros))
            self.dense.process_weights_after_loading(layer, dtype)
        if codes is not None:
            group_size = q.shape[1] // scales.shape[1]
            layer.kernel = lambda x: codes_kernel(x, *codes, group_size, layer.output_size)
            layer.kernel_max_rows = CODES_MAX_ROWS
            if not self._codes_sum_as_dense(layer):
                layer.kernel = None  # it must give the dequantized weight's bits, row for row

    def _codes_sum_as_dense(self, layer) -> bool:
        """Whether the codes' float32 kernel gives the bits of the dequantized weight's own product (dense_linear, or
        oneDNN where that is not the kernel at these rows: then it does not) at 1, 2 and 3 rows and at CODES_MAX_ROWS
        (the kernel's passes take 1, 2, 3 or 4 rows)."""
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(m, layer.input_size, generator=gen) for m in (1, 2, 3, CODES_MAX_ROWS)]
        return all(torch.equal(self.apply(layer, x), self.dense.apply(layer, x)) for x in xs)

    def apply(self, layer, x):
        if layer.kernel is not None and (layer.kernel_max_rows is None or x.shape[0] <= layer.kernel_max_rows):
            out = layer.kernel(x)
            return out if layer.bias is None else out + layer.bias
        return self.dense.apply(layer, x)


def _create_codes_or_weight(layer) -> None:
    # A tensor arrives as codes, scales and zeros (a GGUF type held natively, or codes the loader cached), or as a
    # float weight; the shapes come with it (vLLM's GGUF method materializes its parameters on load the same way).
    for name in ("weight", "qweight", "scales", "zeros"):
        layer.register_parameter(name, UninitializedParameter(requires_grad=False))


def _take_codes_or_weight(layer) -> tuple[tuple | None, torch.Tensor | None]:
    """(codes, scales, zeros) if the file held the tensor as codes, else its float weight; the parameters
    themselves are dropped from the layer."""
    names = ("weight", "qweight", "scales", "zeros")
    loaded = {n: getattr(layer, n).detach() for n in names if not isinstance(getattr(layer, n), UninitializedParameter)}
    for name in names:
        _register(layer, name, None)
    if "qweight" in loaded:
        return (loaded["qweight"], loaded["scales"], loaded["zeros"]), None
    if "weight" not in loaded:
        raise ValueError(f"no weight was loaded for a {type(layer).__name__}")
    return None, loaded["weight"]


class _QuantizeAtLoad(GroupQuantLinearMethod):
    """Codes the loader quantized from the checkpoint's float weights and cached (loader.prepare_quantized_weights),
    or a float weight, quantized here once it is loaded."""

    def create_weights(self, layer, input_size, output_size):
        _create_codes_or_weight(layer)

    def quantize(self, w: torch.Tensor):
        raise NotImplementedError

    def process_weights_after_loading(self, layer, dtype):
        codes, weight = _take_codes_or_weight(layer)
        self.process_codes(layer, *(codes or self.quantize(weight.float())), dtype)


class Int8LinearMethod(_QuantizeAtLoad):
    def quantize(self, w):
        return quantize_int8(w, group_size=w.shape[1])


class Int4LinearMethod(_QuantizeAtLoad):
    def quantize(self, w):
        return quantize_int4(w, INT4_GROUP_SIZE)


class GGUFLinearMethod(GroupQuantLinearMethod):
    def create_weights(self, layer, input_size, output_size):
        _create_codes_or_weight(layer)

    def process_weights_after_loading(self, layer, dtype):
        codes, weight = _take_codes_or_weight(layer)
        if codes is not None:
            self.process_codes(layer, *codes, dtype)
        else:
            layer.kernel = None
            _register(layer, "weight", weight)
            self.dense.process_weights_after_loading(layer, dtype)


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    def create_weights(self, layer, input_size, output_size):
        _register(layer, "weight", torch.empty(input_size, output_size))

    def process_weights_after_loading(self, layer, dtype):
        layer.weight.data = layer.weight.data.to(dtype)

    def apply(self, layer, ids):
        return F.embedding(ids, layer.weight)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """A GGUF embedding table kept as stored: each step dequantizes only the rows it looks up."""

    def create_weights(self, layer, input_size, output_size):
        _create_codes_or_weight(layer)

    def process_weights_after_loading(self, layer, dtype):
        layer.codes, weight = _take_codes_or_weight(layer)
        layer.dtype = dtype
        if weight is not None:
            _register(layer, "weight", weight.to(dtype))

    def apply(self, layer, ids):
        if layer.codes is None:
            return F.embedding(ids, layer.weight)
        q, scales, zeros = layer.codes
        return dequantize(q[ids], scales[ids], zeros[ids]).to(layer.dtype)


class GroupQuantMoEMethod:
    """A FusedMoE layer's experts as group-wise codes (vLLM's quantized FusedMoE methods): w13_codes (codes [E, 2I, H],
    scales and zeros [E, 2I, H // group]) and w2_codes ([E, H, I], ...), kernels/quant.py's format with a leading
    expert dimension, kept outside the parameters so that casting the model leaves the float32 scales alone.

    A checkpoint's expert tensors arrive one an expert and projection: as codes (a GGUF's, or the loader's int8/int4
    cache), or float, which int8 and int4 quantize here; under gguf a float one (a type the engine keeps no codes for)
    makes the whole layer float, in w13_weight and w2_weight, as the unquantized layer holds it."""

    def __init__(self, quantization: str):
        self.quantization = quantization

    def create_weights(self, layer: nn.Module) -> None:
        # Empty until the layer is complete; the loader reports them loaded then.
        _register(layer, "w13_weight", torch.empty(0))
        _register(layer, "w2_weight", torch.empty(0))
        layer.expert_parts, layer.whole_parts = {}, set()

    def load(self, layer: nn.Module, tensor: torch.Tensor, expert: int, shard: str, kind: str) -> list[str]:
        """Keep one tensor of a local expert's projection (shard w1, w3 or w2; kind weight, qweight, scales or
        zeros); once every expert's projections are whole, build the layer: the parameters that completes."""
        part = layer.expert_parts.setdefault((expert, shard), {})
        part[kind] = tensor
        if "weight" in part or len(part) == 3:
            layer.whole_parts.add((expert, shard))
        if len(layer.whole_parts) < 3 * layer.num_local_experts:
            return []
        parts = {key: self._rank_part(layer, part, key[1]) for key, part in layer.expert_parts.items()}
        layer.expert_parts, layer.whole_parts = {}, set()
        experts = range(layer.num_local_experts)
        device = layer.w13_weight.device
        if self.quantization == "gguf" and any("weight" in p for p in parts.values()):

            def weight(part):
                return part["weight"].float() if "weight" in part else dequantize(*self._codes(part))

            w13 = torch.stack([torch.cat([weight(parts[e, "w1"]), weight(parts[e, "w3"])]) for e in experts])
            layer.w13_weight.data = w13.to(device)
            layer.w2_weight.data = torch.stack([weight(parts[e, "w2"]) for e in experts]).to(device)
            return ["w13_weight", "w2_weight"]
        layer.w13_codes = _stack_codes([[self._codes(parts[e, s]) for s in ("w1", "w3")] for e in experts], device)
        layer.w2_codes = _stack_codes([[self._codes(parts[e, "w2"])] for e in experts], device)
        return ["w13_weight", "w2_weight"]

    def _codes(self, part: dict) -> tuple:
        if "weight" not in part:
            return part["qweight"], part["scales"].float(), part["zeros"].float()
        return get_linear_method(self.quantization).quantize(part["weight"].float())

    @staticmethod
    def _rank_part(layer: nn.Module, part: dict, shard: str) -> dict:
        """This tensor-parallel rank's slice of a projection: its rows of gate and up, its columns of down (whole
        quantization groups of them)."""
        if layer.tp_size == 1:
            return part
        if shard != "w2" or "weight" in part:
            return {kind: layer._rank_part(t, 1 if shard == "w2" else 0) for kind, t in part.items()}
        size = layer.intermediate_size_per_partition
        group = part["qweight"].shape[1] // part["scales"].shape[1]
        if size % group:
            raise ValueError(
                f"--tensor-parallel-size {layer.tp_size} gives each rank {size} columns of the experts' down "
                f"projection, not whole quantization groups of {group}; serve with a size that does"
            )
        groups = slice(layer.tp_rank * size // group, (layer.tp_rank + 1) * size // group)
        return {
            "qweight": layer._rank_part(part["qweight"], 1),
            "scales": part["scales"][:, groups],
            "zeros": part["zeros"][:, groups],
        }


def _stack_codes(experts: list[list[tuple]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's projections (codes, scales, zeros), their rows stacked in order, with a leading expert dimension;
    scales of different group sizes (GGUF's Q4_K beside Q6_K) repeated to the finest first, which keeps every
    weight's value."""
    groups = max(codes[1].shape[1] for parts in experts for codes in parts)

    def stacked(i):
        rows = [torch.cat([c[i].repeat_interleave(groups // c[i].shape[1], dim=1) if i else c[i] for c in parts])
                for parts in experts]  # fmt: skip
        return torch.stack(rows).contiguous().to(device)

    return stacked(0), stacked(1), stacked(2)


# Methods whose codes are made from a float checkpoint: the loader quantizes it once and caches the codes.
QUANTIZED_AT_LOAD = ("int8", "int4")
_LINEAR_METHODS = {
    None: UnquantizedLinearMethod,
    "int8": Int8LinearMethod,
    "int4": Int4LinearMethod,
    "gguf": GGUFLinearMethod,
}


def get_linear_method(quantization: str | None) -> LinearMethodBase:
    return _LINEAR_METHODS[quantization]()


def get_embedding_method(quantization: str | None) -> QuantizeMethodBase:
    # int8 and int4 quantize the matmuls only; an embedding lookup reads a few rows, not the whole table.
    return GGUFEmbeddingMethod() if quantization == "gguf" else UnquantizedEmbeddingMethod()


def check_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device) -> None:
    """Fail at start-up on a combination that cannot run, naming the flags and the values that can."""
    if quantization in ("int8", "int4") and dtype not in _QUANTIZED_ACT_DTYPES:
        raise ValueError(
            f"--quantization {quantization} computes in bfloat16 or float16, not {str(dtype).removeprefix('torch.')}; "
            "pass --dtype bfloat16 or --dtype float16"
        )
    if quantization == "int4" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        raise ValueError("--quantization int4 needs a GPU of compute capability 8.0 or newer on CUDA")


# Checkpoint formats a family's loader dequantizes as its weights load (the model then runs unquantized, or with
# --quantization), and the architectures whose loaders do.
DEQUANTIZED_AT_LOAD = {"mxfp4": ("GptOssForCausalLM",)}


def resolve_quantization(requested: str | None, checkpoint: str | None, architecture: str = "") -> str | None:
    """The method to run: --quantization, else the checkpoint's own. A GGUF checkpoint may also be
    dequantized and quantized again with int8 or int4."""
    if checkpoint in DEQUANTIZED_AT_LOAD:
        if architecture not in DEQUANTIZED_AT_LOAD[checkpoint]:
            raise ValueError(
                f"the checkpoint is quantized with {checkpoint!r}, which this engine dequantizes only for "
                f"{', '.join(DEQUANTIZED_AT_LOAD[checkpoint])}, not {architecture}"
            )
        if requested == "gguf":
            raise ValueError("--quantization gguf needs a .gguf model file")
        return requested
    if checkpoint not in (None, "gguf"):
        raise ValueError(
            f"the checkpoint is quantized with {checkpoint!r}, which this engine cannot load; it loads gguf, and "
            f"{', '.join(DEQUANTIZED_AT_LOAD)} for {', '.join(a for v in DEQUANTIZED_AT_LOAD.values() for a in v)}"
        )
    if requested == "gguf" and checkpoint != "gguf":
        raise ValueError("--quantization gguf needs a .gguf model file")
    return requested or checkpoint
