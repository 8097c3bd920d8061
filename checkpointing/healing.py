"""Peer-to-peer healing: a rank's model and optimizer state as plain local tensors.

Groups hold identical state, and ranks at the same ``(pp, shard, tp)`` position hold identical
shards, so a healing rank takes its peer's local shards verbatim and re-wraps them in its
own mesh's DTensor layout. ``local_state`` is that state as views of the rank's own tensors
(what ``workers.state_transfer`` streams to the peer); ``export_local_state`` the same copied
to host memory, so it travels through the Ray object store (the heal's fallback).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach()
    if isinstance(value, torch.Tensor):
        return value.detach()
    return value


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The rank's local shards of its parameters and optimizer state, without a copy."""
    optim_state = optimizer.state_dict()
    return {
        "model": [_local(param) for param in model.parameters()],
        "optimizer": {
            "state": {index: {key: _local(value) for key, value in entry.items()}
                      for index, entry in optim_state["state"].items()},
            "param_groups": optim_state["param_groups"],
        },
    }


def export_local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``local_state`` with its tensors copied to host memory."""
    state = local_state(model, optimizer)
    return {
        "model": tree_map(_host_copy, state["model"]),
        "optimizer": {"state": tree_map(_host_copy, state["optimizer"]["state"]),
                      "param_groups": state["optimizer"]["param_groups"]},
    }


def _host_copy(value: Any) -> Any:
    return value.to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local.to(param.device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local.to(param.device)


def import_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    params = list(model.parameters())
    if len(params) != len(state["model"]):
        raise ValueError(f"peer state has {len(state['model'])} parameters, this model has {len(params)}")
    with torch.no_grad():
        for param, local in zip(params, state["model"]):
            target = param.to_local() if isinstance(param, DTensor) else param
            target.copy_(local)
    optimizer_state = {
        "state": {
            index: {
                key: _like(params[index], value) if torch.is_tensor(value) and value.dim() > 0 else value
                for key, value in entry.items()
            }
            for index, entry in state["optimizer"]["state"].items()
        },
        "param_groups": state["optimizer"]["param_groups"],
    }
    optimizer.load_state_dict(optimizer_state)
