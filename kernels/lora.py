"""Multi-LoRA kernels (Punica's shrink and expand): each token's adapter delta for a whole mixed batch.

One layer's adapters sit in fixed slots: lora_a [slots, L * R, in] and lora_b [slots, R, out] (B transposed, so
that the CPU's expand streams its rows), zero-padded past each adapter's rank. A packed layer, q/k/v or gate/up, has
L slices: slice i owns rows [i * R, (i + 1) * R) of A, and its output columns (slice_sizes[i] of them, in order) of
B, which so holds every slice's R rows side by side, without zeros between them. Token t uses slot
token_lora_indices[t]; -1 is the base model, which gets no delta.

    shrink: h[t] = x[t] @ lora_a[slot].T                                  (float32 accumulation)
    expand: y[t, slice i] += h[t, i * R : (i + 1) * R] @ lora_b[slot][:, slice i]   (added into the base output)

Three implementations of the same arithmetic: the torch reference (a gathered bmm), the Triton kernel (the GPU
path, one gathered matrix-vector product for both; one program per token and output tile, so any mix of adapters is
one launch), and the CPU path, a C++ kernel (kernels/cpu/lora.cpp) doing both for a whole layer in one call, packed
slices included: a layer's few small torch calls per adapter cost more than their arithmetic on the CPU. It takes
the step's tokens grouped by slot (lora_kernel_meta, once per step, vLLM's LoRAKernelMeta) and reads a slot's rows
once for each block of up to 8 of its tokens, with its accumulators in registers; with x and the slots in bfloat16,
a prompt's group of 16 tokens or more goes through two matrix multiplies on the CPU's matrix unit instead (AMX,
ATen's brgemm), h rounded to bfloat16 between them as vLLM's kernels round it. Slots may be float32, bfloat16 or
float16 (--lora-dtype); every path widens them to float32 as it reads them.
"""

import torch
import triton
import triton.language as tl

# ---- torch reference -------------------------------------------------------------------------------------------


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, token_lora_indices: torch.Tensor) -> torch.Tensor:
    """h [tokens, R] float32; rows of base-model tokens are zero."""
    h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    rows = (token_lora_indices >= 0).nonzero().squeeze(1)
    a = lora_a[token_lora_indices[rows]].float()  # [rows, R, in]
    h[rows] = torch.bmm(a, x[rows].float().unsqueeze(2)).squeeze(2)
    return h


def lora_expand_ref(
    h: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor, y: torch.Tensor, slice_sizes: list[int]
) -> None:
    """y += h @ B per token and slice, in place; base-model rows untouched."""
    rows = (token_lora_indices >= 0).nonzero().squeeze(1)
    b = lora_b[token_lora_indices[rows]].float()  # [rows, R, out]
    rank, offset = lora_b.shape[1], 0
    for i, size in enumerate(slice_sizes):
        hi = h[rows, i * rank : (i + 1) * rank].unsqueeze(1)
        y[rows, offset : offset + size] += torch.bmm(hi, b[:, :, offset : offset + size]).squeeze(1).to(y.dtype)
        offset += size


# ---- CPU: one C++ call per layer ---------------------------------------------------------------------------------


def lora_kernel_meta(token_lora_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's tokens grouped by slot, for the CPU kernel (host tensors, int64): token_indices_sorted_by_lora_ids
    (base-model tokens left out), active_lora_ids (each group's slot) and lora_token_start_loc (where each group
    starts in the sorted tokens, and the end)."""
    sorted_slots, order = torch.sort(token_lora_indices, stable=True)
    adapted = sorted_slots >= 0
    active_lora_ids, counts = torch.unique_consecutive(sorted_slots[adapted], return_counts=True)
    start_loc = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=start_loc[1:])
    return order[adapted], active_lora_ids, start_loc


def lora_cpu_kernel():
    """The CPU path (kernels/cpu/lora.cpp): lora_apply(x, y, lora_a, lora_b, token_indices_sorted_by_lora_ids,
    active_lora_ids, lora_token_start_loc, slot_ranks, slice_sizes) adds a layer's whole delta into y in place, the
    tokens grouped as lora_kernel_meta gives them, reading only each slot's own rank (slot_ranks: int64 [slots]);
    slice_sizes are the packed slices' output sizes, whose A rows and B columns are the slice's index times the
    slot's rank on."""
    from kernels.cpu_ops import load

    load()  # registers torch.ops.llmmesh_lora
    return torch.ops.llmmesh_lora.lora_apply


# ---- Triton ------------------------------------------------------------------------------------------------------


@triton.jit
def _gathered_matvec_kernel(
    out_ptr, w_ptr, idx_ptr, v_ptr, N, K, stride_ot, stride_ws, stride_wn, stride_wk, stride_vt,
    ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[t, n] (+)= sum_k w[slot(t), n, k] * v[t, k] in float32; tokens of slot -1 are skipped. Shrink is this with
    w = A (n over R, k over in), expand with w = B transposed back (n over out, k over R) and ACCUMULATE."""
    t = tl.program_id(0)
    slot = tl.load(idx_ptr + t)
    if slot < 0:
        return  # a base-model token: no delta
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(v_ptr + t * stride_vt + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + slot * stride_ws + n[:, None] * stride_wn + k[None, :] * stride_wk,
            mask=(n[:, None] < N) & (k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * v[None, :], axis=1)
    out_ptrs = out_ptr + t * stride_ot + n
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n < N)


def _gathered_matvec(out, w, token_lora_indices, v, accumulate: bool) -> None:
    assert out.stride(1) == 1 and v.stride(1) == 1
    num_tokens, (_, n, k) = v.shape[0], w.shape
    block_n = min(64, triton.next_power_of_2(n))
    grid = (num_tokens, triton.cdiv(n, block_n))
    _gathered_matvec_kernel[grid](
        out, w, token_lora_indices, v, n, k, out.stride(0), w.stride(0), w.stride(1), w.stride(2), v.stride(0),
        ACCUMULATE=accumulate, BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora_indices: torch.Tensor) -> torch.Tensor:
    """The Triton shrink: h [tokens, R] float32, as lora_shrink_ref."""
    h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    _gathered_matvec(h, lora_a, token_lora_indices, x, accumulate=False)
    return h


def lora_expand(
    h: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor, y: torch.Tensor, slice_sizes: list[int]
) -> None:
    """The Triton expand: y += h @ B per token and slice, in place, as lora_expand_ref (one launch a slice)."""
    rank, offset = lora_b.shape[1], 0
    for i, size in enumerate(slice_sizes):
        b = lora_b[:, :, offset : offset + size].transpose(1, 2)
        _gathered_matvec(y[:, offset : offset + size], b, token_lora_indices, h[:, i * rank : (i + 1) * rank], True)
        offset += size
