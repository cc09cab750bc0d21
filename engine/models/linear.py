"""Linear layers whose CPU matmul goes through oneDNN with the weight packed once, after loading.

PyTorch's CPU `F.linear` calls MKL's sgemm. On the AMD EPYC development machine oneDNN's packed
float32 GEMM measured 1.3-1.9x faster on this model's shapes (3.4x on the lm_head at 16 rows;
docs/benchmarks.md), and it needs no code of ours. vLLM's CPU backend does the same
(`dispatch_cpu_unquantized_gemm`). On a GPU, or where oneDNN cannot take the dtype, the layer is plain.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout, once packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def pack_for_cpu(self, keep_weight: bool) -> None:
        """Pack the weight for oneDNN; drop the plain copy unless something else shares it (a tied embedding)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_weight:
            self.weight = None


def onednn_supports(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linear_weights(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Pack every Linear of a loaded model (already in its final dtype) for oneDNN; how many were packed."""
    if not onednn_supports(device, dtype):
        return 0
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.pack_for_cpu(keep_weight=id(layer.weight) in shared)
    return len(layers)
