"""The mixture-of-experts layer (vLLM's FusedMoE): a router picks each token's top-k experts, and the experts' gated
MLPs run on the tokens routed to them, weighted by the router's probabilities and summed back per token.

The experts' weights are stacked, one tensor a projection: w13_weight [E, 2 * I, H] holds each expert's gate and up
projections (gate rows first), w2_weight [E, H, I] its down projection. The computation groups the step's
(token, expert) pairs by expert: sorted by expert, each expert with tokens multiplies its contiguous slice of rows,
and the weighted results are added back to their tokens. No token passes through an expert that did not pick it.

Tensor parallelism as vLLM's without expert parallelism: each rank holds every expert's slice of the intermediate
dimension (w13's rows of gate and of up, w2's columns), computes a partial output, and one all-reduce sums them, as
a RowParallelLinear's ranks do.

Expert parallelism (--enable-expert-parallel) over the same N ranks: each rank holds E / N whole experts, a
contiguous run (vLLM's linear placement: rank r has experts r * E / N onwards). Every rank already has every token
(attention's all-reduce leaves the hidden states whole on each), so the dispatch is local: a rank routes all the
tokens, keeps the (token, expert) pairs of its own experts and runs them at their full width, and the combine is
the same one all-reduce of [tokens, hidden] that tensor parallelism pays (vLLM's naive all-gather / reduce-scatter
dispatch, with one data-parallel rank). So it moves no fewer bytes than tensor parallelism; what it buys is whole
experts (one matmul pair an expert at full width, no slicing of narrow experts), and its step waits for the rank
whose experts drew the most pairs. An all-to-all that sends each token only to its experts' ranks is the
bandwidth-saving scheme, not built here.

gpt-oss's experts differ in two ways, both optional here: biases on both projections (w13_bias, this rank's part;
w2_bias, added by rank 0 alone, before the all-reduce, as a RowParallelLinear's bias), and another gated activation
(act_fn over the [gate | up] halves: swigluoai_and_mul).

Quantized experts (--quantization int8 or int4, or a GGUF's blocks) are held as group-wise codes by
quantization.GroupQuantMoEMethod; the C++ experts read them row by row, the torch ones dequantize only the experts a
step routes to.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import (
    all_reduce,
    divide,
    get_ep_rank,
    get_ep_size,
    get_tp_rank,
    get_tp_size,
)
from engine.models.config import ModelArchConfig
from engine.models.layers import silu_and_mul
from engine.models.linear import NUM_EXPERTS_FIELDS, Linear
from engine.models.quantization import GroupQuantMoEMethod
from kernels.quant import DequantizedExperts


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts by softmax probability (float32, as transformers computes it) and their weights,
    renormalised to sum to 1 where the model says so (Mixtral always; Qwen's MoE by norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def swigluoai_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over the fused [gate | up] halves, in transformers' order: the gate clamped above at
    limit, up on both sides, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn=silu_and_mul,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert[topk_ids[t, k]](x[t]), each expert a gated MLP (act_fn over
    [gate | up], SiLU's by default), with the (token, expert) pairs grouped by expert: one matmul pair per expert that
    has tokens."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    # Pairs in expert order; within an expert, in token order (stable), so each token's sum runs in expert order.
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x[token_of]
    out = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            b13, b2 = (None, None) if w13_bias is None else (w13_bias[expert], w2_bias[expert])
            h = act_fn(F.linear(rows[start : start + n], w13[expert], b13))
            out[start : start + n] = F.linear(h, w2[expert], b2)
            start += n
    out = (out * topk_weights.flatten()[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out)


class FusedMoE(nn.Module):
    """The experts of one MoE layer and their routing; forward(x, router_logits) -> the layer's output, summed over
    the tensor-parallel ranks. On the CPU kernels (layers.use_cpu_ops) the experts run in one C++ call
    (kernels/cpu/moe.cpp), which differs from fused_experts by float rounding only."""

    ops = None

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        quantization: str | None = None,
        act_fn=silu_and_mul,
        has_bias: bool = False,
    ):
        super().__init__()
        if quantization is not None and (act_fn is not silu_and_mul or has_bias):
            raise ValueError(
                f"--quantization {quantization} is not implemented for experts with biases or another activation "
                "than SiLU's (gpt-oss's); serve this model unquantized"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # With expert parallelism this rank's experts are whole (tensor parallelism of 1 inside them).
        self.ep_rank, self.ep_size = get_ep_rank(), get_ep_size()
        self.num_local_experts = num_local_experts(num_experts, self.ep_size)
        self.expert_start = self.ep_rank * self.num_local_experts
        self.tp_rank, self.tp_size = (0, 1) if self.ep_size > 1 else (get_tp_rank(), get_tp_size())
        self.intermediate_size_per_partition = divide(
            intermediate_size, self.tp_size, "the experts' MLP width (their intermediate size)"
        )
        size, local = self.intermediate_size_per_partition, self.num_local_experts
        self.quant_method = None if quantization is None else GroupQuantMoEMethod(quantization)
        self.w13_codes = self.w2_codes = None  # (codes, scales, zeros) of quantized experts
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
        else:
            self.w13_weight = nn.Parameter(torch.empty(local, 2 * size, hidden_size), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, size), requires_grad=False)
        self.act_fn = act_fn
        self.w13_bias = self.w2_bias = None
        if has_bias:
            self.w13_bias = nn.Parameter(torch.zeros(local, 2 * size), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(local, hidden_size), requires_grad=False)
        self._loaded: dict[str, set] = {"w13_weight": set(), "w2_weight": set()}

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)
        return self.forward_experts(x, topk_weights, topk_ids)

    def forward_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' output for a routing (topk_ids over all E experts), summed over the ranks."""
        if self.ep_size > 1:
            token_of, weights, ids = self._local_pairs(topk_weights, topk_ids)
            out = torch.zeros_like(x).index_add_(0, token_of, self._experts(x[token_of], weights, ids))
        else:
            out = self._experts(x, topk_weights, topk_ids)
        return all_reduce(out) if get_tp_size() > 1 else out

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.w13_codes is not None:
            if self.ops is not None and x.dtype in (torch.float32, torch.bfloat16):
                return self.ops.fused_moe_quant(x.contiguous(), *self.w13_codes, *self.w2_codes, topk_weights, topk_ids)
            w13, w2 = DequantizedExperts(*self.w13_codes, x.dtype), DequantizedExperts(*self.w2_codes, x.dtype)
            return fused_experts(x, w13, w2, topk_weights, topk_ids)
        # The C++ and Triton experts are SiLU's without biases.
        plain = self.act_fn is silu_and_mul and self.w13_bias is None
        if not plain:
            weights = self.w13_weight, self.w2_weight, topk_weights, topk_ids
            return fused_experts(x, *weights, self.act_fn, self.w13_bias, self.w2_bias)
        if self.ops is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self.ops.fused_moe(x.contiguous(), self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if x.is_cuda:
            # Two Triton launches (kernels/fused_moe.py), imported here so that machines without triton import this.
            from kernels.fused_moe import fused_experts as triton_fused_experts

            return triton_fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def _local_pairs(
        self, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, expert) pairs routed to this rank's experts, each as a token of its own with one expert:
        their tokens [P], weights [P, 1] and local expert ids [P, 1]."""
        local_ids = topk_ids - self.expert_start
        token_of, slot = ((local_ids >= 0) & (local_ids < self.num_local_experts)).nonzero(as_tuple=True)
        return token_of, topk_weights[token_of, slot, None], local_ids[token_of, slot, None]

    # ---- weight loading ---------------------------------------------------------------------------------------

    def _rank_part(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        size = self.intermediate_size_per_partition
        if tensor.shape[dim] != size * self.tp_size:
            raise ValueError(
                f"an expert weight of shape {tuple(tensor.shape)} does not have the experts' intermediate size "
                f"{size * self.tp_size} along dimension {dim}"
            )
        return tensor.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, tensor: torch.Tensor, expert: int, shard: str, kind: str = "weight") -> list[str]:
        """Copy one expert's checkpoint projection in (shard: "w1" gate, "w3" up, "w2" down: Mixtral's names), this
        rank's part of it (none of another rank's expert); the parameters this completes. Quantized experts also
        take the projection's codes (kind: qweight, scales, zeros)."""
        size = self.intermediate_size_per_partition
        expert -= self.expert_start
        if not 0 <= expert < self.num_local_experts:
            return []
        if self.quant_method is not None:
            return self.quant_method.load(self, tensor, expert, shard, kind)
        if kind != "weight":
            raise ValueError(f"Checkpoint has quantized experts ({kind}) for a layer without quantization")
        with torch.no_grad():
            if shard == "w2":
                self.w2_weight[expert].copy_(self._rank_part(tensor, 1))
            else:
                rows = slice(0, size) if shard == "w1" else slice(size, 2 * size)
                self.w13_weight[expert, rows].copy_(self._rank_part(tensor, 0))
        return self._mark("w2_weight" if shard == "w2" else "w13_weight", {(expert, shard)})

    def stacked_weight_loader(self, tensor: torch.Tensor, name: str) -> list[str]:
        """Copy every expert's projection at once, as transformers >= 5 may store them: gate_up_proj [E, 2I, H]
        (gate rows first), down_proj [E, H, I]; and their biases where the experts have them, gate_up_proj_bias
        [E, 2I], down_proj_bias [E, H]."""
        if name.endswith("_bias") and self.w13_bias is None:
            raise ValueError(f"Checkpoint has expert biases ({name}) for experts without them")
        if self.quant_method is not None:  # quantized one expert at a time
            if name == "down_proj":
                return [p for e, w in enumerate(tensor) for p in self.weight_loader(w, e, "w2")]
            pairs = (w.chunk(2) for w in tensor)
            return [p for e, (gate, up) in enumerate(pairs) for s, w in (("w1", gate), ("w3", up))
                    for p in self.weight_loader(w, e, s)]  # fmt: skip
        tensor = tensor.narrow(0, self.expert_start, self.num_local_experts)  # this rank's experts
        local = range(self.num_local_experts)
        with torch.no_grad():
            if name == "gate_up_proj_bias":
                gate, up = tensor.chunk(2, dim=1)
                self.w13_bias.copy_(torch.cat([self._rank_part(gate, 1), self._rank_part(up, 1)], dim=1))
                return ["w13_bias"]
            if name == "down_proj_bias":  # added once: by tensor-parallel rank 0, or by each expert's own rank
                self.w2_bias.copy_(tensor if self.tp_rank == 0 else torch.zeros_like(tensor))
                return ["w2_bias"]
            if name == "down_proj":
                self.w2_weight.copy_(self._rank_part(tensor, 2))
                return self._mark("w2_weight", {(e, "w2") for e in local})
            gate, up = tensor.chunk(2, dim=1)
            self.w13_weight.copy_(torch.cat([self._rank_part(gate, 1), self._rank_part(up, 1)], dim=1))
        return self._mark("w13_weight", {(e, s) for e in local for s in ("w1", "w3")})

    def _mark(self, param: str, parts: set) -> list[str]:
        loaded = self._loaded[param]
        loaded |= parts
        want = self.num_local_experts * (2 if param == "w13_weight" else 1)
        return [param] if len(loaded) == want else []


def num_local_experts(num_experts: int, ep_size: int) -> int:
    """Each rank's share of the experts, or a start-up error naming the flag when they do not split evenly."""
    if num_experts % ep_size:
        raise ValueError(
            f"--enable-expert-parallel needs the model's {num_experts} experts to divide by --tensor-parallel-size "
            f"{ep_size}; pick a size that divides it, or serve without --enable-expert-parallel"
        )
    return num_experts // ep_size


def check_expert_parallel(config: ModelArchConfig, size: int) -> None:
    """A start-up error unless the model has mixture-of-experts layers whose experts split over `size` ranks."""
    num_experts = next((config.hf_config[f] for f in NUM_EXPERTS_FIELDS if config.hf_config.get(f)), 0)
    if not num_experts:
        raise ValueError(
            f"--enable-expert-parallel splits mixture-of-experts layers, and {config.architecture} has none; "
            "serve it without --enable-expert-parallel"
        )
    num_local_experts(int(num_experts), size)


# A checkpoint's expert tensors: per expert (experts.3.w1.weight, experts.3.gate_proj.weight) or stacked
# (experts.gate_up_proj, experts.down_proj).
_EXPERT_TENSOR = re.compile(
    r"(?P<moe>(?:.+\.)?experts)\.(?:(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|qweight|scales|zeros)|(?P<stacked>\w+))"
)
_STACKED = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def expert_weight_loader(model: nn.Module, proj_names: dict[str, str]):
    """load_fused_weights' load_other for a model with FusedMoE layers: places each expert tensor in its layer's
    stacked weights. proj_names maps the checkpoint's per-expert projection names to w1 (gate), w3 (up), w2
    (down)."""
    modules = dict(model.named_modules())

    def load(name: str, tensor: torch.Tensor) -> list[str] | None:
        match = _EXPERT_TENSOR.fullmatch(name)
        moe = modules.get(match["moe"]) if match else None
        if not isinstance(moe, FusedMoE):
            return None
        if match["stacked"] in _STACKED:
            done = moe.stacked_weight_loader(tensor, match["stacked"])
        elif match["proj"] in proj_names and int(match["expert"]) < moe.num_experts:
            done = moe.weight_loader(tensor, int(match["expert"]), proj_names[match["proj"]], match["kind"])
        else:
            raise ValueError(f"Checkpoint has an unexpected expert weight {name!r}")
        return [f"{match['moe']}.{param}" for param in done]

    return load


class SparseMoeBlock(nn.Module):
    """A router (gate: hidden -> one logit an expert, replicated on every rank, unquantized as in vLLM) and the
    experts it routes to: Mixtral's block_sparse_moe, Qwen3-MoE's mlp."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        quantization: str | None = None,
    ):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
