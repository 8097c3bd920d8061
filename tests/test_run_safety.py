"""What a run refuses or reports so that nothing committed is lost and no failure reads as
success: resumes that would change the math, credentials in URLs, a summary that cannot be
written. No Ray needed."""

from __future__ import annotations

import logging

import pytest

from checkpointing.catalog import Restorable
from checkpointing.manifest import FileRecord, Manifest
from elastic.cli import exit_code
from elastic.config import ConfigError
from elastic.core.events import EventLog
from elastic.trainer import ElasticTrainer, check_resumable, config_hash, config_record
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


def test_a_resume_may_change_layout_steps_and_checkpoint_settings(tmp_path):
    saved = checkpoint_of(tiny_config(tmp_path))
    other = tiny_config(tmp_path, groups=3, shard=2, steps=90, checkpoint__every=7, checkpoint__keep=5)
    check_resumable(other, "r", saved)


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
    summary = {"exit": "completed"}
    assert trainer._save_summary(summary) is None
    assert summary["exit"].startswith("failed: summary not written (PermissionError: read-only bucket)")
    assert summary["exit"].endswith("the run ended: completed")
    assert exit_code(summary["exit"]) == 1


def test_the_rendezvous_keys_are_hidden_under_a_secret_per_run_prefix():
    import datetime

    import torch.distributed as dist

    from elastic.fleet import Rendezvous

    run, other_run = Rendezvous.start(), Rendezvous.start()
    assert run.prefix != other_run.prefix and len(run.prefix) >= 32

    def client(prefix: str = ""):
        store = dist.TCPStore(run.host, run.port, is_master=False, timeout=datetime.timedelta(seconds=5))
        return dist.PrefixStore(prefix, store) if prefix else store

    client(run.prefix).set("gen1/group0/rank0", "address of rank 0")  # what a rank's rendezvous writes
    outsider = client()
    assert not outsider.check(["gen1/group0/rank0"]), "a process without the prefix sees the run's keys"
    assert client(run.prefix).get("gen1/group0/rank0") == b"address of rank 0"
