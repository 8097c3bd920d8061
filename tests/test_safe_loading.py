"""A rank loads DCP checkpoints without running code from storage: the metadata through an
allow-list unpickler, the optimizer's plain values as weights only. One process, no Ray."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from checkpointing.rank_io import SafeLoadPlanner, SafeReader

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    return model, optimizer


def state_of(model, optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def failures(raised) -> str:
    """What each rank's DCP load raised (DCP gathers them into one exception)."""
    return "\n".join(str(failure) for failure in raised.value.failures.values())


def load(directory, state) -> None:
    dcp.load(state, storage_reader=SafeReader(str(directory)), planner=SafeLoadPlanner())


def test_a_checkpoint_loads_whole_through_the_safe_reader(tmp_path):
    saved = state_of(*trained())
    dcp.save(saved, checkpoint_id=str(tmp_path))
    fresh = state_of(*trained())
    for tensor in fresh["model"].values():
        tensor.zero_()
    fresh["optimizer"]["param_groups"][0]["lr"] = 0.5
    load(tmp_path, fresh)
    for name, tensor in saved["model"].items():
        assert torch.equal(fresh["model"][name], tensor)
    assert fresh["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert fresh["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)


def leave_a_mark(path: str) -> None:
    open(path, "w").close()


class RunsCode:
    """Unpickling it calls ``leave_a_mark``: the mark tells whether code from storage ran."""

    def __init__(self, mark):
        self.mark = str(mark)

    def __reduce__(self):
        return (leave_a_mark, (self.mark,))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    saved = state_of(*trained())
    dcp.save(saved, checkpoint_id=str(tmp_path))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(tmp_path / "ran")))
    with pytest.raises(CheckpointException) as raised:
        load(tmp_path, state_of(*trained()))
    assert f".metadata refers to {leave_a_mark.__module__}.leave_a_mark, which DCP metadata never holds: refused" \
        in failures(raised)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("forged", ["/etc/passwd", "../../outside.distcp", ".metadata"])
def test_metadata_that_places_data_outside_the_checkpoints_files_is_refused(tmp_path, forged):
    """A forged ``relative_path`` would have a rank (or an export) read any file at all."""
    from dataclasses import replace

    from checkpointing.safe_loading import load_metadata

    saved = state_of(*trained())
    dcp.save(saved, checkpoint_id=str(tmp_path))
    metadata = load_metadata(open(tmp_path / ".metadata", "rb"))
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = replace(metadata.storage_data[index], relative_path=forged)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointException) as raised:
        load(tmp_path, state_of(*trained()))
    assert f".metadata places data in {forged!r}, not a file DCP writes" in failures(raised)


def test_an_optimizer_value_that_would_run_code_is_refused(tmp_path):
    saved = state_of(*trained())
    saved["optimizer"]["param_groups"][0]["poison"] = RunsCode(tmp_path / "ran")  # saved as a bytes item
    dcp.save(saved, checkpoint_id=str(tmp_path))
    target = state_of(*trained())
    target["optimizer"]["param_groups"][0]["poison"] = None
    with pytest.raises(CheckpointException) as raised:
        load(tmp_path, target)
    assert "optimizer.param_groups.0.poison is not plain data: refused" in failures(raised)
    assert not (tmp_path / "ran").exists()
