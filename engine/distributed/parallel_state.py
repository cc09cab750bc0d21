"""The tensor- and pipeline-parallel process groups (vLLM's parallel_state): gloo on CPU, NCCL on CUDA.

Ranks meet at rank 0's address and port (torch.distributed's MASTER_ADDR and MASTER_PORT, which the executor
reads), so they may live on separate hosts. Every collective has the group's timeout: a rank that stops
answering fails the others' collectives after it instead of hanging them. Without init_distributed a process is
rank 0 of 1; a layer built then never calls a collective, so a model runs unchanged on one device.

Expert parallelism (--enable-expert-parallel) uses the same group as its expert-parallel group (vLLM's EP group with
one data-parallel rank): its mixture-of-experts layers hold whole experts, E / N a rank, instead of a slice of
every expert.

Pipeline parallelism (--pipeline-parallel-size P) runs P stages of TP ranks each, TP x P ranks in all, laid out as
vLLM lays them: tensor-parallel ranks innermost, so rank = pp_rank * TP + tp_rank, and a stage's TP ranks form its
tensor-parallel group. Activations pass from each rank to the rank of the same tp_rank in the next stage
(send_to_next_stage, recv_from_prev_stage).

With fixed_order (--batch-invariant on, on a CPU), all_reduce adds the ranks' parts in rank order. Gloo's ring
all-reduce starts each element's sum at a rank that depends on where the element falls among the tensor's chunks, so
on more than two ranks a row's sum would depend on how many rows the step holds (two addends commute exactly).
"""

import datetime
import os

import torch
import torch.distributed as dist

# Seconds a collective waits for the other ranks before it fails: a rank gone or stopped ends the step in this
# time at most (a rank that exits is seen sooner: its connections close).
COLLECTIVE_TIMEOUT_S = 60.0

_tp_rank, _tp_size = 0, 1
_pp_rank, _pp_size = 0, 1
_tp_group = None  # this stage's ranks; None: every rank (no pipeline parallelism)
_enable_expert_parallel = False
_fixed_order = False  # all_reduce sums in rank order (batch invariance)
# Sends to the next stage not yet known to be done, each with its tensor, which must live until then.
_pending_sends: list = []


def init_distributed(
    rank: int,
    world_size: int,
    device: torch.device,
    master_addr: str,
    master_port: int,
    enable_expert_parallel: bool = False,
    tensor_parallel_size: int | None = None,
    fixed_order: bool = False,
) -> None:
    """Join the group of `world_size` ranks as `rank`, meeting rank 0 at master_addr:master_port; with
    tensor_parallel_size below world_size, the ranks are world_size / tensor_parallel_size pipeline stages;
    fixed_order: on a CPU, all_reduce sums the ranks' parts in rank order."""
    global _tp_rank, _tp_size, _pp_rank, _pp_size, _tp_group, _enable_expert_parallel, _fixed_order
    tp = tensor_parallel_size or world_size
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    _tp_rank, _tp_size, _pp_rank, _pp_size = rank % tp, tp, rank // tp, world_size // tp
    _enable_expert_parallel = enable_expert_parallel
    # On a GPU the layers are not batch invariant anyway (docs/determinism.md): NCCL's all-reduce stays.
    _fixed_order = fixed_order and device.type == "cpu"
    if _pp_size > 1:  # every rank creates every stage's group, in the same order
        groups = [dist.new_group(list(range(stage * tp, (stage + 1) * tp))) for stage in range(_pp_size)]
        _tp_group = groups[_pp_rank]


def set_cpu_threads(local_world_size: int) -> None:
    """Share this host's cores among its ranks: torch's default of one thread per core in each of N ranks would
    run N threads on every core. $OMP_NUM_THREADS, when set, is each rank's count instead."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size))


def destroy_distributed() -> None:
    global _tp_rank, _tp_size, _pp_rank, _pp_size, _tp_group, _enable_expert_parallel, _fixed_order
    _pending_sends.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_rank, _tp_size, _pp_rank, _pp_size, _tp_group, _enable_expert_parallel = 0, 1, 0, 1, None, False
    _fixed_order = False


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def get_pp_rank() -> int:
    return _pp_rank


def get_pp_size() -> int:
    return _pp_size


def is_first_stage() -> bool:
    return _pp_rank == 0


def is_last_stage() -> bool:
    return _pp_rank == _pp_size - 1


def get_ep_rank() -> int:
    """This rank's place among the ranks that split the experts (0 without expert parallelism)."""
    return _tp_rank if _enable_expert_parallel else 0


def get_ep_size() -> int:
    """How many ranks split the experts between them: every rank with expert parallelism, else 1."""
    return _tp_size if _enable_expert_parallel else 1


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a start-up error naming what does not split."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) does not divide by --tensor-parallel-size {denominator}; pick a size that divides it"
        )
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks (in place), on every rank; with fixed_order on more than two ranks, in rank order,
    (x0 + x1) + x2 ... in float32, whatever x's shape."""
    if not _fixed_order or _tp_size <= 2:
        dist.all_reduce(x, group=_tp_group)
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return x.copy_(total)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along dim, in rank order, on every rank."""
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(tensors: dict[str, torch.Tensor]) -> None:
    """Send a stage's activations (vLLM's IntermediateTensors) to the next stage's rank of this tp_rank, in name
    order, without waiting for it to take them: a stage goes on to the next batch meanwhile. The previous sends are
    done first, so at most one batch's tensors are held."""
    for work, _ in _pending_sends:
        work.wait()
    _pending_sends.clear()
    peer = (_pp_rank + 1) * _tp_size + _tp_rank
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        _pending_sends.append((dist.isend(tensor, peer), tensor))


def recv_from_prev_stage(shapes: dict[str, tuple], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The previous stage's activations for this batch, named and shaped as `shapes` says."""
    peer = (_pp_rank - 1) * _tp_size + _tp_rank
    tensors = {}
    for name in sorted(shapes):
        tensors[name] = torch.empty(shapes[name], dtype=dtype, device=device)
        dist.recv(tensors[name], peer)
    return tensors
