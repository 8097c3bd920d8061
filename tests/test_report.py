"""Tests for elastic.outputs.report: breakdown table, timeline PNG and the ``elastic report`` entry point,
on synthetic summaries and on a real run with an injected kill."""

from __future__ import annotations

import json
import math
import random

import pytest

from elastic.outputs.report import (
    CATEGORIES,
    format_breakdown,
    goodput_breakdown,
    load_summary,
    main,
    report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_summary(run: str = "demo-run", ranks: int = 8, n_steps: int = 40, seed: int = 0) -> dict:
    """A realistic summary: rank 3 dies at t=10 and is recovered; rank 5 straggles and is
    mitigated; two checkpoints commit; the time breakdown adds up to wall_s."""
    rng = random.Random(seed)
    failed_rank, straggler = 3, 5
    startup, step_nominal = 2.0, 0.5
    t = startup
    steps, events = [], [
        {"t": 0.0, "kind": "run-started"},
        {"t": 1.5, "kind": "group-started", "group": 0},
    ]
    committed = discarded = recovery = ckpt_stall = 0.0
    live = list(range(ranks))
    loss = 4.0
    step = 0
    generation = 0
    while step < n_steps:
        if t >= 10.0 and failed_rank in live and generation == 0:
            # the step in flight is lost, detection + rebuild + heal costs 3 s
            t += 0.3
            discarded += 0.3
            events += [
                {"t": round(t, 4), "kind": "rank-failed", "rank": failed_rank, "cause": "death"},
                {"t": round(t, 4), "kind": "step-discarded", "step": step},
                {"t": round(t + 0.5, 4), "kind": "rank-evicted", "rank": failed_rank},
                {"t": round(t + 1.5, 4), "kind": "groups-rebuilt", "groups": 1},
                {"t": round(t + 3.0, 4), "kind": "group-healed", "seconds": 1.5},
                {"t": round(t + 3.0, 4), "kind": "recovered", "cause": "death", "detect_s": 0.5,
                 "rebuild_s": 1.0, "heal_s": 1.5, "total_s": 3.0},
            ]
            live = [r for r in live if r != failed_rank]
            t += 3.0
            recovery += 3.0
            generation += 1
        slow = 1.0
        if straggler in live and 12 <= step < 20:
            slow = 1.8
        rank_times = {}
        for r in live:
            base = step_nominal * (1 + 0.05 * rng.random())
            rank_times[str(r)] = round(base * (slow if r == straggler else 1.0), 4)
        step_s = max(rank_times.values())
        t += step_s
        committed += step_s
        loss = loss * 0.95 + 0.02 * rng.random()
        steps.append({
            "step": step, "t": round(t, 4), "loss": round(loss, 5), "step_s": step_s,
            "live_ranks": len(live), "live_groups": 1, "generation": generation,
            "rank_step_s": rank_times,
        })
        if step == 14:
            events.append({"t": round(t, 4), "kind": "straggler-detected", "rank": straggler,
                           "step": step, "score": 3.2})
        if step == 19:
            events.append({"t": round(t, 4), "kind": "straggler-mitigated", "action": "rebalance",
                           "rank": straggler, "step": step, "predicted_gain": 0.3,
                           "measured_gain": 0.27})
        if step in (15, 35):
            t += 0.4
            ckpt_stall += 0.4
            events.append({"t": round(t, 4), "kind": "checkpoint-committed", "step": step,
                           "bytes": 123456, "seconds": 0.4})
        step += 1
    idle = 0.75
    wall = t + idle
    breakdown = {"wall_s": wall, "startup": startup, "committed": committed, "discarded": discarded,
                 "recovery": recovery, "checkpoint_stall": ckpt_stall, "idle": idle}
    events.append({"t": round(wall, 4), "kind": "run-finished"})
    return {
        "run": run,
        "config": {"model": "tiny", "steps": n_steps},
        "topology": {"groups": 1, "shard": ranks, "tp": 1, "ranks": ranks},
        "steps_committed": n_steps,
        "steps_discarded": 1,
        "losses": [s["loss"] for s in steps],
        "final_loss": steps[-1]["loss"],
        "wall_s": wall,
        "tokens_per_s": 12345.6,
        "goodput": committed / wall,
        "resumed_from_step": None,
        "time_breakdown": breakdown,
        "steps": steps,
        "events": events,
        "exit": "completed",
    }


def write_run(tmp_path, summary: dict):
    run_dir = tmp_path / summary["run"]
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def assert_valid_png(path) -> None:
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000


def test_report_writes_png_and_breakdown(tmp_path):
    summary = make_summary()
    run_dir = write_run(tmp_path, summary)

    png, breakdown = report(str(run_dir))

    assert png == str(run_dir / "timeline.png")
    assert_valid_png(png)
    assert list(breakdown) == [*CATEGORIES, "wall_s"]
    parts = sum(v for k, v in breakdown.items() if k != "wall_s")
    assert math.isclose(parts, breakdown["wall_s"], rel_tol=1e-9)
    assert math.isclose(breakdown["wall_s"], summary["wall_s"])
    assert breakdown["recovery"] == pytest.approx(3.0)


def test_report_accepts_summary_path_and_explicit_output(tmp_path):
    run_dir = write_run(tmp_path, make_summary())
    out = tmp_path / "plots" / "custom.png"
    png, _ = report(str(run_dir / "summary.json"), str(out))
    assert png == str(out)
    assert_valid_png(out)
    # file:// URLs go through fsspec as well
    assert load_summary(f"file://{run_dir}")["run"] == "demo-run"


def test_heatmap_with_many_ranks(tmp_path):
    summary = make_summary(run="big-run", ranks=32, n_steps=40, seed=1)
    run_dir = write_run(tmp_path, summary)
    png, breakdown = report(str(run_dir))
    assert_valid_png(png)
    assert math.isclose(sum(v for k, v in breakdown.items() if k != "wall_s"), breakdown["wall_s"],
                        rel_tol=1e-9)


def test_main_prints_every_category(tmp_path, capsys):
    run_dir = write_run(tmp_path, make_summary())
    out = tmp_path / "cli.png"
    assert main([str(run_dir), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    for category in (*CATEGORIES, "total", "goodput"):
        assert category in printed
    assert str(out) in printed
    assert_valid_png(out)


def test_missing_run_gives_clear_error(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    with pytest.raises(FileNotFoundError) as err:
        report(str(missing))
    assert str(missing / "summary.json") in str(err.value)
    assert main([str(missing)]) == 1
    assert "no-such-run" in capsys.readouterr().err


def test_breakdown_idle_remainder_and_mismatch():
    summary = make_summary()
    del summary["time_breakdown"]["idle"]
    breakdown = goodput_breakdown(summary)
    assert breakdown["idle"] == pytest.approx(0.75)

    summary["time_breakdown"]["idle"] = 5.0  # parts no longer add up
    with pytest.raises(ValueError, match="does not add up"):
        goodput_breakdown(summary)


def test_format_breakdown_table():
    breakdown = {"committed": 80.0, "recovery": 10.0, "discarded": 2.0, "checkpoint_stall": 3.0,
                 "startup": 4.0, "idle": 1.0, "wall_s": 100.0}
    table = format_breakdown(breakdown)
    lines = table.splitlines()
    assert "80.0%" in next(line for line in lines if line.startswith("committed"))
    assert "goodput" in next(line for line in lines if line.startswith("committed"))
    assert any(line.startswith("total") and "100.0%" in line for line in lines)
    assert "goodput = committed / wall = 80.0%" in table


def test_remote_url_writes_png_to_current_directory(tmp_path, monkeypatch):
    import fsspec

    summary = make_summary(run="remote-run")
    with fsspec.open("memory://bucket/prefix/remote-run/summary.json", "w") as handle:
        handle.write(json.dumps(summary))
    monkeypatch.chdir(tmp_path)
    png, breakdown = report("memory://bucket/prefix/remote-run")
    assert png == str(tmp_path / "remote-run-timeline.png")
    assert_valid_png(png)
    assert breakdown["wall_s"] == pytest.approx(summary["wall_s"])
    with pytest.raises(FileNotFoundError, match="memory://bucket/prefix/gone/summary.json"):
        load_summary("memory://bucket/prefix/gone")


def test_crashed_run_without_steps_still_plots(tmp_path):
    summary = make_summary(run="crashed")
    summary.update(steps=[], losses=[], final_loss=None, steps_committed=0,
                   exit="RuntimeError: all groups lost")
    summary["events"] = summary["events"][:4]
    tb = summary["time_breakdown"]
    tb["idle"] += tb["committed"]
    tb["committed"] = 0.0
    png, breakdown = report(str(write_run(tmp_path, summary)))
    assert open(png, "rb").read(8) == PNG_MAGIC
    assert breakdown["committed"] == 0.0


def test_report_on_a_real_run_with_a_kill(ray_cluster, tmp_path, capsys):
    from elastic import ElasticTrainer
    from elastic.cli import main as elastic_main
    from tests.tiny import tiny_config

    config = tiny_config(tmp_path, groups=2, steps=12, fault_tolerance__inject="kill:rank=1,step=4", eval__every=6,
                         fault_tolerance__min_deadline_s=3.0, fault_tolerance__deadline_factor=4.0)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    capsys.readouterr()

    out = tmp_path / "timeline.png"
    assert elastic_main(["report", result.run_dir, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert_valid_png(out)
    for category in (*CATEGORIES, "total", "goodput"):
        assert category in printed

    breakdown = goodput_breakdown(load_summary(result.run_dir))
    parts = {k: v for k, v in breakdown.items() if k != "wall_s"}
    assert math.isclose(sum(parts.values()), breakdown["wall_s"], rel_tol=1e-9)
    assert breakdown["wall_s"] == pytest.approx(result.summary["wall_s"], rel=1e-3)
    # the kill shows up where it belongs: a discarded step and a recovery, besides training
    for category in ("startup", "committed", "discarded", "recovery", "evaluation"):
        assert parts[category] > 0, f"{category}: {parts}"
    assert [e["step"] for e in result.summary["eval"]] == [6, 12]


def test_event_labels_close_in_time_read_as_one():
    from elastic.outputs.report import merged_labels

    labels = [(75.1, "rank 3 death", "red"), (75.2, "rank 3 death evicted", "red"), (75.2, "rank 3 death", "red"),
              (75.4, "rank 0 stuck-in-collective evicted", "red"), (90.0, "ckpt failed", "red")]
    assert merged_labels(labels, 2.0) == [
        (75.1, ["rank 3 death", "rank 3 death evicted", "rank 0 stuck-in-collective evicted"], "red"),
        (90.0, ["ckpt failed"], "red"),
    ]


def test_a_run_of_several_legs_keeps_every_leg_and_the_report_adds_them_up(tmp_path):
    """One run, one history (elastic.outputs.run_record): a leg keeps the legs before it, an
    unreadable record is moved aside, never overwritten, and the report is the whole run's."""
    import fsspec

    from elastic.outputs.report import whole_run
    from elastic.outputs.run_record import earlier_legs, with_history, write_summary

    fs = fsspec.filesystem("file")
    directory = str(tmp_path / "run")
    assert earlier_legs(fs, directory, "demo-run") == []
    first = make_summary()
    write_summary(fs, directory, with_history(first, earlier_legs(fs, directory, "demo-run")))
    second = {**make_summary(), "resumed_from_step": 20, "exit": "preempted"}
    write_summary(fs, directory, with_history(second, earlier_legs(fs, directory, "demo-run")))
    recorded = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert recorded["leg"] == 2 and recorded["earlier_legs"] == [{**first, "leg": 1}]
    total = recorded["run_total"]
    assert total["exits"] == ["completed", "preempted"] and total["steps_committed"] == 2 * first["steps_committed"]
    assert total["wall_s"] == pytest.approx(2 * first["wall_s"]) and total["goodput"] == pytest.approx(first["goodput"])

    drawn = whole_run(recorded)  # each leg's start-up is drawn where that leg began
    assert drawn["leg_starts"] == [0.0, pytest.approx(first["time_breakdown"]["wall_s"])]
    assert drawn["leg_startup_s"] == [first["time_breakdown"]["startup"]] * 2
    png, breakdown = report(directory)
    assert_valid_png(png)
    assert breakdown["wall_s"] == pytest.approx(2 * first["wall_s"])

    (tmp_path / "run" / "summary.json").write_text("{not json")
    assert earlier_legs(fs, directory, "demo-run") == []
    [aside] = (tmp_path / "run").glob("summary-unreadable-*.json")
    assert aside.read_text() == "{not json"
