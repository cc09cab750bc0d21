"""The tensor-parallel process group (vLLM's parallel_state, one group): gloo on CPU, NCCL on CUDA.

Ranks meet at rank 0's address and port (torch.distributed's MASTER_ADDR and MASTER_PORT, which the executor
reads), so they may live on separate hosts. Every collective has the group's timeout: a rank that stops
answering fails the others' collectives after it instead of hanging them. Without init_distributed a process is
rank 0 of 1; a layer built then never calls a collective, so a model runs unchanged on one device.

Expert parallelism (--enable-expert-parallel) uses the same group as its expert-parallel group (vLLM's EP group with
one data-parallel rank): its mixture-of-experts layers hold whole experts, E / N a rank, instead of a slice of
every expert.
"""

import datetime
import os

import torch
import torch.distributed as dist

# Seconds a collective waits for the other ranks before it fails: a rank gone or stopped ends the step in this
# time at most (a rank that exits is seen sooner: its connections close).
COLLECTIVE_TIMEOUT_S = 60.0

_tp_rank, _tp_size = 0, 1
_enable_expert_parallel = False


def init_distributed(
    rank: int,
    world_size: int,
    device: torch.device,
    master_addr: str,
    master_port: int,
    enable_expert_parallel: bool = False,
) -> None:
    """Join the group of `world_size` ranks as `rank`, meeting rank 0 at master_addr:master_port."""
    global _tp_rank, _tp_size, _enable_expert_parallel
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    _tp_rank, _tp_size, _enable_expert_parallel = rank, world_size, enable_expert_parallel


def set_cpu_threads(local_world_size: int) -> None:
    """Share this host's cores among its ranks: torch's default of one thread per core in each of N ranks would
    run N threads on every core. $OMP_NUM_THREADS, when set, is each rank's count instead."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size))


def destroy_distributed() -> None:
    global _tp_rank, _tp_size, _enable_expert_parallel
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_rank, _tp_size, _enable_expert_parallel = 0, 1, False


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


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
    """The sum of x over the ranks (in place), on every rank."""
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along dim, in rank order, on every rank."""
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
