"""Tensor-parallel rank/size and the two collectives the model needs. Without an initialized process group
everything behaves as a single rank, so layers work unchanged in tests and single-GPU runs."""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x across ranks in place (a no-op on one rank)."""
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's x along the last dim on rank 0; other ranks get None."""
    size = get_tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if get_tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp(rank: int, world_size: int, port: int, device_type: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def destroy_tp() -> None:
    if is_distributed():
        dist.destroy_process_group()
