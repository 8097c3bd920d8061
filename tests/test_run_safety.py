"""What a run refuses or reports so that nothing committed is lost and no failure reads as
success: resumes that would change the math, credentials in URLs, a summary that cannot be
written. No Ray needed."""

from __future__ import annotations

import logging

import socket

import pytest

from checkpointing.catalog import Restorable
from checkpointing.manifest import FileRecord, Manifest
from elastic.core.exits import Exit
from elastic.setup.config import ConfigError
from elastic.core.events import EventLog
from elastic.setup.resume_checks import check_resumable, config_hash, config_record
from elastic.outputs.summary import RunSummary
from elastic.trainer import ElasticTrainer
from tests.tiny import tiny_config


def checkpoint_of(config, step=40) -> Restorable:
    manifest = Manifest(step=step, cursor={"epoch": 0, "position": 320}, topology={"shard": 1, "tp": 1},
                        config_hash=config_hash(config), config=config_record(config),
                        files=(FileRecord(name="__0_0.distcp", size=1, sha256="0" * 64),))
    return Restorable(f"/runs/r/checkpoints/step-{step:08d}", manifest)


def test_a_resume_with_other_math_settings_is_refused_naming_them(tmp_path):
    saved = checkpoint_of(tiny_config(tmp_path))
    changed = tiny_config(tmp_path, seed=4, model__dim=64)
    with pytest.raises(ConfigError, match=r"model\.dim: 32 -> 64, seed: 3 -> 4; .*--run-name"):
        check_resumable(changed, "r", saved)


def test_a_checkpoint_written_before_a_setting_existed_resumes_at_that_settings_default(tmp_path):
    saved = checkpoint_of(tiny_config(tmp_path))
    del saved.manifest.config["model"]["dropout"], saved.manifest.config["optimizer"]["clip_grad_norm"]
    check_resumable(tiny_config(tmp_path), "r", saved)
    with pytest.raises(ConfigError, match=r"model\.dropout: 0\.0 -> 0\.1"):
        check_resumable(tiny_config(tmp_path, model__dropout=0.1), "r", saved)
    # the source's max_position_embeddings, which a run from a HuggingFace model now records:
    # for elastic export, not the math, so a run started before it resumes
    check_resumable(tiny_config(tmp_path, model__max_position_embeddings=2048), "r", saved)


def test_a_resume_may_change_layout_steps_and_checkpoint_settings(tmp_path):
    saved = checkpoint_of(tiny_config(tmp_path))
    other = tiny_config(tmp_path, groups=3, shard=2, steps=90, checkpoint__every=7, checkpoint__keep=5)
    check_resumable(other, "r", saved)


def test_a_resume_keeps_how_the_groups_merge_their_work(tmp_path):
    """DiLoCo's checkpoint holds an outer momentum, and every-step's none: a resume that changes
    the mode, or a round's settings, is refused; a run that never set ``sync`` records none."""
    every_step = checkpoint_of(tiny_config(tmp_path, steps=40))
    assert "sync" not in every_step.manifest.config
    diloco = tiny_config(tmp_path, steps=40, sync__mode="diloco", sync__outer_every=4)
    with pytest.raises(ConfigError, match=r"sync\.mode: 'every-step' -> 'diloco'"):
        check_resumable(diloco, "r", every_step)
    check_resumable(diloco, "r", checkpoint_of(diloco))
    with pytest.raises(ConfigError, match=r"sync\.outer_every: 4 -> 8"):
        check_resumable(tiny_config(tmp_path, steps=40, sync__mode="diloco", sync__outer_every=8), "r",
                        checkpoint_of(diloco))


def test_credentials_in_urls_never_reach_the_log(caplog):
    events = EventLog(lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="elastic.events"):
        events.emit("resumed", step=5, url="s3://AKIAXXXX:hunter2@bucket/run/checkpoints/step-00000005")
    assert "hunter2" not in caplog.text and "s3://***@bucket/run" in caplog.text


def test_a_summary_that_cannot_be_written_fails_the_run_and_keeps_why_it_ended(tmp_path, monkeypatch):
    trainer = ElasticTrainer(tiny_config(tmp_path))

    def unwritable(summary):
        raise PermissionError("read-only bucket")

    monkeypatch.setattr(trainer, "_write_summary", unwritable)
    path, summary = trainer._save_summary(RunSummary(exit="completed"))
    assert path is None
    assert summary.exit.startswith("failed: summary not written (PermissionError: read-only bucket)")
    assert summary.exit.endswith("the run ended: completed")
    assert Exit.parse(summary.exit).code == 1


def test_the_rendezvous_store_refuses_an_outsider_on_this_machines_own_address():
    from elastic.fleet.rendezvous import Rendezvous
    from elastic.testing.loopback import own_outside_address

    rendezvous = Rendezvous.start("127.0.0.1")  # a local run's node address
    outside = own_outside_address()
    assert outside != "127.0.0.1"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((outside, rendezvous.port), timeout=5).close()
    socket.create_connection(("127.0.0.1", rendezvous.port), timeout=5).close()


def test_an_outsider_who_lists_the_rendezvous_keys_finds_nothing_usable():
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from elastic.fleet.rendezvous import Rendezvous
    from workers.keyed_store import KeyedStore, StoreTampered

    run, other_run = Rendezvous.start("127.0.0.1"), Rendezvous.start("127.0.0.1")
    assert run.secret != other_run.secret and len(run.secret) >= 64

    def client():
        return dist.TCPStore(run.host, run.port, is_master=False, timeout=datetime.timedelta(seconds=10))

    # the ranks' own rendezvous over the keyed store works: two ranks of a gloo group sum
    sums = {}

    def rank(index: int) -> None:
        keyed = KeyedStore(client(), run.secret)  # referenced while torch uses it, as a rank does
        group = dist.ProcessGroupGloo(dist.PrefixStore("gen1/group0/", keyed), index, 2,
                                      datetime.timedelta(seconds=10))
        tensor = torch.tensor([index + 1.0])
        group.allreduce([tensor]).wait()
        sums[index] = tensor.item()

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sums == {0: 3.0, 1: 3.0}

    ranks_view = KeyedStore(client(), run.secret)
    ranks_view.set("gen2/group0/rank0", "10.0.0.7:29500")
    outsider = client()
    keys = outsider.list_keys()
    assert keys and not any(word in key for key in keys for word in ("gen", "group", "rank", "replicate"))
    assert not outsider.check(["gen2/group0/rank0"])
    for key in keys:  # overwrite whatever it found: a rank trusts none of it
        outsider.set(key, "attacker:1")
    with pytest.raises(StoreTampered, match="not written by this run"):
        ranks_view.get("gen2/group0/rank0")
    assert KeyedStore(client(), other_run.secret).check(["gen2/group0/rank0"]) is False

def test_a_resume_over_changed_data_is_refused_naming_the_file_unless_accepted(tmp_path):
    import numpy as np

    from elastic.core.events import EventKind
    from elastic.setup.resume_checks import resume_over_data

    path = tmp_path / "train.bin"
    np.arange(4_000, dtype="<u2").tofile(path)
    config = tiny_config(tmp_path, data__path=str(path), data__validation_fraction=0.0, eval__every=0)
    trained_on = ElasticTrainer(config, model_fn=lambda: None).data_identity
    assert list(trained_on) == [str(path)] and trained_on[str(path)].startswith("8000 bytes, sha256 ")
    manifest = Manifest(step=4, cursor={"epoch": 2, "position": 24}, topology={"shard": 1, "tp": 1},
                        config_hash="h", data=trained_on, files=(FileRecord(name=".metadata", size=1, sha256="0" * 64),))
    checkpoint = Restorable("file:///run/checkpoints/step-00000004", manifest)
    events = EventLog(lambda: 0.0)
    assert resume_over_data(config, "r", checkpoint, trained_on, events) is checkpoint

    np.arange(8_000, dtype="<u2").tofile(path)  # the corpus doubled under the same path
    now = ElasticTrainer(config, model_fn=lambda: None).data_identity
    with pytest.raises(ConfigError, match=rf"resumes from step 4, but its data changed since: {path}: 8000 bytes.* -> "
                                          r"16000 bytes.*--accept-changed-data"):
        resume_over_data(config, "r", checkpoint, now, events)
    accepted = tiny_config(tmp_path, data__path=str(path), data__validation_fraction=0.0, eval__every=0,
                           checkpoint__accept_changed_data=True)
    resumed = resume_over_data(accepted, "r", checkpoint, now, events)
    assert resumed.step == 4 and resumed.manifest.cursor == {"epoch": 0, "position": 0}  # the data over, cleanly
    [event] = events.of_kind(EventKind.DATA_CHANGED)
    assert event["files"] == [str(path)]


def test_a_dataset_of_other_samples_is_refused_before_any_actor_starts(tmp_path):
    import torch

    def refused(sample, message):
        with pytest.raises(ConfigError, match=message):
            ElasticTrainer(tiny_config(tmp_path, eval__every=0), dataset=[sample] * 100)

    ids = torch.zeros(33, dtype=torch.int64)
    forms = r"each sample must be a 1-D integer tensor of data.seq_len \+ 1 = 33 token ids"
    refused({"text": "a"}, rf"^dataset: sample 0 is a dict with keys \['text'\] and no input_ids; {forms}")
    refused(torch.zeros(33), rf"^dataset: sample 0 is a tensor of dtype torch.float32 and shape \(33,\); {forms}")
    refused({"input_ids": ids[:-1]}, r"^dataset: sample 0's input_ids is a tensor of dtype torch.int64 and shape "
                                      r"\(32,\)")
    refused({"input_ids": ids, "labels": ids[:-1]}, r"^dataset: sample 0's labels is a tensor .* shape \(32,\)")
    refused({"input_ids": ids, "labels": torch.full((33,), -5)}, r"^dataset: sample 0 has a negative label \(-5\)")
    refused(ids + 256, r"^dataset: sample 0 has token id 256, outside the model's vocabulary of 256: raise "
                         r"model.vocab_size or re-tokenize$")
    refused("some text", rf"^dataset: sample 0 is a str; {forms}")
    refused({"input_ids": "some text"}, rf"^dataset: sample 0 cannot be read as token ids \(.*\); {forms}")
    # HuggingFace's forms are taken: tensors, or lists as a dataset without a torch format gives them
    masked = torch.cat([torch.full((10,), -100), ids[10:]])
    ElasticTrainer(tiny_config(tmp_path, eval__every=0), dataset=[{"input_ids": ids, "labels": masked}] * 100)
    ElasticTrainer(tiny_config(tmp_path, eval__every=0), dataset=[{"input_ids": ids.tolist()}] * 100)


def test_tensor_parallelism_for_a_custom_model_without_a_plan_is_refused_up_front(tmp_path):
    import torch

    def model_fn():
        return torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))

    with pytest.raises(ConfigError, match=r"^scaling.tp = 2 needs a tensor-parallel plan for Sequential: pass "
                                          r"tp_plan\(model, tp_mesh\)"):
        ElasticTrainer(tiny_config(tmp_path, tp=2), model_fn=model_fn)
    ElasticTrainer(tiny_config(tmp_path, tp=2), model_fn=model_fn, tp_plan=lambda model, mesh: None)
    ElasticTrainer(tiny_config(tmp_path, tp=2))  # the reference model has its own plan
    with pytest.raises(ConfigError, match="tp_plan: give it or parallelize_fn, not both"):
        ElasticTrainer(tiny_config(tmp_path, tp=2), model_fn=model_fn, tp_plan=lambda model, mesh: None,
                       parallelize_fn=lambda model, mesh: model)


def test_an_optimizer_fn_that_returns_no_optimizer_is_refused_up_front_naming_the_hook(tmp_path):
    import torch

    with pytest.raises(ConfigError, match=r"^optimizer_fn: returned NoneType, not an optimizer; return a "
                                          r"torch.optim.Optimizer"):
        ElasticTrainer(tiny_config(tmp_path), optimizer_fn=lambda parameters: None)
    ElasticTrainer(tiny_config(tmp_path), optimizer_fn=lambda parameters: torch.optim.SGD(parameters, lr=0.1))
