"""Tests for elastic.outputs.report: breakdown table, timeline PNG and the ``elastic report`` entry point,
on synthetic summaries and on a real run with an injected kill."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from elastic.core.goodput import CATEGORIES
from elastic.outputs.report import format_breakdown, load_summary, main, report
from elastic.outputs.summary import RunSummary, StepEntry
from elastic.outputs.timeline import Timeline, TimelineStep, goodput_breakdown, whole_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_summary(run: str = "demo-run", ranks: int = 8, n_steps: int = 40, seed: int = 0) -> dict:
    """A realistic summary: one group of ``ranks``; rank 3 dies at t=10 and is replaced; rank 5
    straggles and is mitigated; two checkpoints commit; the time breakdown adds up to wall_s."""
    rng = random.Random(seed)
    failed_rank, straggler = 3, 5
    startup, step_nominal = 2.0, 0.5
    t = startup
    steps, events = [], [
        {"t": 0.0, "kind": "run-started"},
        {"t": 0.1, "kind": "group-reserved", "group": 0},
        {"t": 1.5, "kind": "group-built", "group": 0, "seconds": 1.4},
        {"t": 1.5, "kind": "group-joined", "group": 0, "generation": 1},
        {"t": 1.5, "kind": "groups-rebuilt", "generation": 1, "groups": [0], "ranks": ranks, "seconds": 0.02},
    ]
    committed = discarded = recovery = ckpt_stall = 0.0
    loss = 4.0
    step = 0
    generation = 0
    while step < n_steps:
        if t >= 10.0 and generation == 0:
            # the step in flight is lost, detection + rebuild + heal costs 3 s
            t += 0.3
            discarded += 0.3
            events += [
                {"t": round(t, 4), "kind": "rank-failed", "rank": failed_rank, "group": 0, "cause": "death"},
                {"t": round(t, 4), "kind": "step-discarded", "step": step, "broken_groups": [0]},
                {"t": round(t + 0.5, 4), "kind": "rank-evicted", "rank": failed_rank, "group": 0, "cause": "death"},
                {"t": round(t + 1.5, 4), "kind": "group-joined", "group": 0, "generation": 3},
                {"t": round(t + 1.5, 4), "kind": "groups-rebuilt", "generation": 3, "groups": [0], "ranks": ranks,
                 "seconds": 0.02},
                {"t": round(t + 3.0, 4), "kind": "group-healed", "seconds": 1.5},
                {"t": round(t + 3.0, 4), "kind": "recovered", "cause": "death", "detect_s": 0.5,
                 "rebuild_s": 1.0, "heal_s": 1.5, "total_s": 3.0},
            ]
            t += 3.0
            recovery += 3.0
            generation += 1
        slow = 1.0
        if 12 <= step < 20:
            slow = 1.8
        rank_times = {}
        for r in range(ranks):
            base = step_nominal * (1 + 0.05 * rng.random())
            rank_times[str(r)] = round(base * (slow if r == straggler else 1.0), 4)
        step_s = max(rank_times.values())
        t += step_s
        committed += step_s
        loss = loss * 0.95 + 0.02 * rng.random()
        steps.append({
            "step": step, "t": round(t, 4), "loss": round(loss, 5), "step_s": step_s,
            "live_ranks": ranks, "live_groups": 1, "generation": generation,
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
    assert load_summary(f"file://{run_dir}").run == "demo-run"


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
    breakdown = goodput_breakdown(RunSummary.model_validate(summary))
    assert breakdown["idle"] == pytest.approx(0.75)

    summary["time_breakdown"]["idle"] = 5.0  # parts no longer add up
    with pytest.raises(ValueError, match="does not add up"):
        goodput_breakdown(RunSummary.model_validate(summary))


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
    from tests.tiny import FAST_DETECTION, tiny_config

    config = tiny_config(tmp_path, groups=2, steps=12, fault_tolerance__inject="kill:rank=1,step=4", eval__every=6,
                         **FAST_DETECTION)
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
    from elastic.outputs.timeline_figure import merged_labels

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

    from elastic.outputs.run_record import earlier_legs, with_history, write_summary

    fs = fsspec.filesystem("file")
    directory = str(tmp_path / "run")
    assert earlier_legs(fs, directory, "demo-run") == []
    first = make_summary()
    write_summary(fs, directory, with_history(RunSummary.model_validate(first), earlier_legs(fs, directory, "demo-run")))
    second = {**make_summary(), "resumed_from_step": 20, "exit": "preempted"}
    write_summary(fs, directory, with_history(RunSummary.model_validate(second), earlier_legs(fs, directory, "demo-run")))
    recorded = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert recorded["leg"] == 2
    assert RunSummary.model_validate(recorded).earlier_legs == [RunSummary.model_validate({**first, "leg": 1})]
    total = recorded["run_total"]
    assert total["exits"] == ["completed", "preempted"] and total["steps_committed"] == 2 * first["steps_committed"]
    assert total["wall_s"] == pytest.approx(2 * first["wall_s"]) and total["goodput"] == pytest.approx(first["goodput"])

    drawn = whole_run(RunSummary.model_validate(recorded))  # each leg's start-up is drawn where that leg began
    assert [start for start, _ in drawn.legs] == [0.0, pytest.approx(first["time_breakdown"]["wall_s"])]
    assert [end - start for start, end in drawn.startups] == [pytest.approx(first["time_breakdown"]["startup"])] * 2
    png, breakdown = report(directory)
    assert_valid_png(png)
    assert breakdown["wall_s"] == pytest.approx(2 * first["wall_s"])

    (tmp_path / "run" / "summary.json").write_text("{not json")
    assert earlier_legs(fs, directory, "demo-run") == []
    [aside] = (tmp_path / "run").glob("summary-unreadable-*.json")
    assert aside.read_text() == "{not json"



def test_a_mixtures_samples_by_source_add_up_over_the_legs_and_the_report_prints_their_shares(tmp_path, capsys):
    import fsspec

    from elastic.outputs.run_record import earlier_legs, with_history, write_summary

    fs = fsspec.filesystem("file")
    directory = str(tmp_path / "run")
    for samples in ({"s3://b/a.parquet": 700, "/data/b.jsonl": 300}, {"s3://b/a.parquet": 70, "/data/b.jsonl": 30}):
        leg = RunSummary.model_validate({**make_summary(), "source_samples": samples})
        write_summary(fs, directory, with_history(leg, earlier_legs(fs, directory, "demo-run")))
    assert RunSummary.read((tmp_path / "run" / "summary.json").read_text()).run_total.source_samples == {
        "s3://b/a.parquet": 770, "/data/b.jsonl": 330}
    assert main([directory, "--output", str(tmp_path / "timeline.png")]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^s3://b/a.parquet +770 +70.0%$", printed, re.MULTILINE)
    assert re.search(r"^/data/b.jsonl +330 +30.0%$", printed, re.MULTILINE)

# ------------------------------------------------------------------- what the timeline draws


def timeline_panels(summary: dict | Timeline) -> dict:
    """The timeline's panels by name: rank (per-rank step times), live (ranks), expert (load,
    None for a dense model), all of its axes, and its events legend (None without events to show)."""
    from elastic.outputs.timeline_figure import timeline_figure

    fig = timeline_figure(summary if isinstance(summary, Timeline) else whole_run(RunSummary.model_validate(summary)))
    titled = {ax.get_title(loc="left"): ax for ax in fig.axes}
    return {
        "rank": next(ax for title, ax in titled.items() if title.startswith("per-rank step time")),
        "live": next(ax for title, ax in titled.items() if title.startswith("rank processes alive")),
        "expert": next((ax for title, ax in titled.items() if title.startswith("expert load")), None),
        "axes": fig.axes,
        "events": next((ax.get_legend() for ax in fig.axes
                        if ax.get_legend() is not None and ax.get_legend().get_title().get_text() == "events"), None),
    }


def drawn_at(line, t: float) -> float:
    """The value a post-style step line holds at time ``t``."""
    import bisect

    xs = list(line.get_xdata())
    assert xs[0] <= t, f"nothing drawn at {t}: the line begins at {xs[0]}"
    return line.get_ydata()[bisect.bisect_right(xs, t) - 1]


def live_ranks_line(summary: dict | Timeline):
    return next(line for line in timeline_panels(summary)["live"].get_lines() if line.get_label() == "rank processes alive")


def one_leg(run: str, startup_s: float, n_steps: int, exit: str, stop_signal: str | None = None,
            ranks: int = 8) -> dict:
    """A leg's summary: its group of ``ranks`` built and joined ``startup_s`` after the leg
    began, then ``n_steps`` of 0.5 s; a ``stop_signal`` asks it to stop before its last step."""
    events = [
        {"t": 0.5, "kind": "run-started", "run": run},
        {"t": 0.6, "kind": "group-reserved", "group": 0},
        {"t": startup_s, "kind": "group-built", "group": 0, "seconds": startup_s - 0.6},
        {"t": startup_s, "kind": "group-joined", "group": 0, "generation": 1},
        {"t": startup_s, "kind": "groups-rebuilt", "generation": 1, "groups": [0], "ranks": ranks, "seconds": 0.02},
    ]
    steps = [{"step": i, "t": startup_s + 0.5 * (i + 1), "loss": 4.0 - 0.1 * i, "step_s": 0.5, "live_ranks": ranks,
              "live_groups": 1, "rank_step_s": {str(rank): 0.5 for rank in range(ranks)}} for i in range(n_steps)]
    if stop_signal:
        events.append({"t": steps[-1]["t"] - 0.2, "kind": "stop-requested", "signal": stop_signal})
    wall = steps[-1]["t"] + 1.0
    events.append({"t": wall, "kind": "run-finished", "exit": exit})
    return {"run": run, "topology": {"groups": 1, "shard": ranks, "tp": 1, "ranks": ranks}, "steps": steps,
            "events": events, "exit": exit, "wall_s": wall, "steps_committed": n_steps, "steps_discarded": 0,
            "time_breakdown": {"wall_s": wall, "startup": startup_s, "committed": 0.5 * n_steps, "idle": 1.0}}


def resumed_run() -> Timeline:
    """A run of two legs, both preempted: the first by SIGTERM, the second, whose ranks take
    60 s to start, by Ctrl-C; as ``elastic report`` draws it."""
    from elastic.outputs.run_record import with_history

    first = one_leg("resumed", startup_s=2.0, n_steps=10, exit="preempted", stop_signal="SIGTERM")
    second = one_leg("resumed", startup_s=60.0, n_steps=10, exit="preempted", stop_signal="SIGINT")
    return whole_run(with_history(RunSummary.model_validate(second), [RunSummary.model_validate(first)]))


def test_a_resume_has_no_live_ranks_until_its_groups_join():
    summary = resumed_run()
    [_, second_leg] = [start for start, _ in summary.legs]
    live = live_ranks_line(summary)

    assert drawn_at(live, 1.0) == 0  # the first leg's start-up: nothing joined yet
    assert drawn_at(live, 3.0) == 8
    for into_start_up in (0.0, 1.0, 30.0, 59.9):  # the resume starts every rank anew
        assert drawn_at(live, second_leg + into_start_up) == 0
    assert drawn_at(live, second_leg + 60.5) == 8  # its group joined


def rollback_run(ranks: int) -> dict:
    """A real run's record (one group of ``ranks``): rank 3 is killed at step 5, four peers
    stuck in its collective are evicted with it, and with no live peer the group rolls back to
    the initial state, which drops the records of the steps before; ranks 1, 2 and 7 (those
    there are) live on through it."""
    evicted = [rank for rank in (0, 4, 5, 6) if rank < ranks]
    events = [
        {"t": 3.5794, "kind": "run-started", "steps": 8, "resume_from": None},
        {"t": 3.5813, "kind": "group-reserved", "group": 0},
        {"t": 18.8604, "kind": "group-built", "group": 0, "seconds": 15.279},
        {"t": 18.8607, "kind": "group-joined", "group": 0, "generation": 1},
        {"t": 18.8832, "kind": "groups-rebuilt", "generation": 1, "groups": [0], "ranks": ranks, "seconds": 0.022},
        {"t": 23.3262, "kind": "fault-injected", "fault": "kill", "ranks": [3], "step": 5},
        {"t": 23.8529, "kind": "rank-failed", "rank": 3, "group": 0, "cause": "death", "step": 5},
        {"t": 23.8547, "kind": "rank-evicted", "rank": 3, "group": 0, "cause": "death"},
        *({"t": 23.8555 + 0.0005 * i, "kind": "rank-evicted", "rank": rank, "group": 0, "cause": "stuck-in-collective"}
          for i, rank in enumerate(evicted)),
        {"t": 23.8585, "kind": "step-discarded", "step": 5, "cause": "death", "culprits": {"3": "death"},
         "broken_groups": [0]},
        {"t": 32.4108, "kind": "group-built", "group": 0, "seconds": 8.551},
        {"t": 32.42, "kind": "restored-initial-state", "step": 0, "groups": [0], "rolled_back_steps": 5, "seed": 0},
        {"t": 32.4201, "kind": "group-joined", "group": 0, "generation": 3},
        {"t": 32.4416, "kind": "groups-rebuilt", "generation": 3, "groups": [0], "ranks": ranks, "seconds": 0.021},
        {"t": 34.0973, "kind": "recovered", "cause": "death", "culprits": {"3": "death"}, "step": 1,
         "detect_s": 0.2522, "drain_s": 0.2534, "rebuild_s": 0.021, "heal_s": 0.0, "total_s": 10.7501},
        {"t": 38.1915, "kind": "checkpoint-committed", "step": 8, "group": 0},
        {"t": 38.1924, "kind": "run-finished", "exit": "completed"},
    ]
    steps = [{"step": i, "t": 34.0972 + 0.5 * i, "loss": 5.5 - 0.25 * i, "step_s": 1.6 if i == 0 else 0.5,
              "live_ranks": ranks, "live_groups": 1, "generation": 3,
              "rank_step_s": {str(rank): (1.2 if i == 0 else 0.5) + 0.001 * rank for rank in range(ranks)}}
             for i in range(8)]
    breakdown = {"wall_s": 38.1926, "committed": 9.9607, "recovery": 8.589, "discarded": 0.5056,
                 "checkpoint_stall": 0.2519, "startup": 15.3039, "idle": 3.5815}
    return {"run": "rollback", "topology": {"groups": 1, "pp": 1, "shard": ranks, "tp": 1, "ranks": ranks},
            "steps": steps, "events": events, "exit": "completed", "wall_s": 38.1926, "time_breakdown": breakdown,
            "steps_committed": 8, "steps_discarded": 1}


def test_live_ranks_follow_the_membership_through_a_rollback():
    from elastic.outputs.timeline import live_membership

    live = live_ranks_line(rollback_run(ranks=8))
    assert drawn_at(live, 10.0) == 0  # start-up
    assert drawn_at(live, 20.0) == 8
    assert drawn_at(live, 23.853) == 7  # rank 3 failed
    for during_the_rollback in (25.0, 30.0, 32.43):
        assert drawn_at(live, during_the_rollback) == 3  # 1, 2 and 7 lived on: 3 and the 4 evicted did not
    assert drawn_at(live, 33.0) == drawn_at(live, 38.0) == 8  # the group joined again, its ranks replaced

    # A rollback to the memory tier after a mismatch: both groups rebuild, no rank is lost.
    mismatch = [
        {"t": 1.0, "kind": "groups-rebuilt", "generation": 1, "groups": [0, 1], "ranks": 8},
        {"t": 5.0, "kind": "step-discarded", "step": 9, "cause": "integrity-mismatch", "broken_groups": [0, 1]},
        {"t": 6.0, "kind": "restored-from-memory", "step": 8, "groups": [0, 1], "rolled_back_steps": 1},
        {"t": 6.5, "kind": "groups-rebuilt", "generation": 3, "groups": [0, 1], "ranks": 8},
    ]
    membership = live_membership(mismatch, [], 10.0)
    assert (membership.t, membership.ranks, membership.groups) == (
        [0.0, 1.0, 5.0, 6.5, 10.0], [0, 8, 8, 8, 8], [0, 2, 0, 2, 2])
    assert membership.downs == []


@pytest.mark.parametrize("ranks", [4, 8, 32])  # a line per rank, a band of ranks, a heatmap
def test_a_failure_is_marked_on_the_lost_ranks_rows_while_they_were_down(ranks):
    from matplotlib.colors import to_hex

    from elastic.outputs.timeline_figure import FAILURE_COLOUR

    summary = rollback_run(ranks)
    lost = {}  # rank -> when it was lost
    for event in summary["events"]:
        if event["kind"] in ("rank-failed", "rank-evicted"):
            lost.setdefault(event["rank"], event["t"])
    back = 32.4416  # the group joined again
    panel = timeline_panels(summary)["rank"]

    marks = []  # (row, since, until) of each line drawn in the failure colour
    for line in panel.get_lines():
        if to_hex(line.get_color()) == FAILURE_COLOUR:
            [row] = set(line.get_ydata())  # on one rank's row, not across the ranks
            since, until = line.get_xdata()
            marks.append((row, since, until))
    # while down, not for the rest of the run
    assert sorted((since, until) for _, since, until in marks) == sorted((t, back) for t in lost.values())
    if ranks > 16:  # a heatmap: a rank's row is its own
        assert sorted(marks) == sorted((float(rank), t, back) for rank, t in lost.items())
    else:  # lines: a rank's row lies among its step times
        for rank, t in lost.items():
            times = [record["rank_step_s"][str(rank)] for record in summary["steps"]]
            assert any(min(times) <= row <= max(times) and (since, until) == (t, back) for row, since, until in marks)


def test_checkpoints_have_a_colour_and_a_legend_entry_of_their_own():
    from matplotlib.colors import to_hex

    summary = make_summary()
    panels = timeline_panels(summary)
    legend = panels["events"]
    entry = dict(zip((text.get_text() for text in legend.get_texts()), legend.legend_handles))["checkpoint committed"]
    checkpoint_colour = to_hex(entry.get_color())

    checkpoint_times = {event["t"] for event in summary["events"] if event["kind"] == "checkpoint-committed"}
    lines = panels["rank"].get_lines()
    at_checkpoints = [line for line in lines if set(line.get_xdata()) <= checkpoint_times]
    assert len(at_checkpoints) == len(checkpoint_times)
    assert {to_hex(line.get_color()) for line in at_checkpoints} == {checkpoint_colour}
    [median] = [line for line in lines if line.get_label().startswith("median of")]
    others = {to_hex(line.get_color()) for line in lines if line not in at_checkpoints}
    assert to_hex(median.get_color()) in others and checkpoint_colour not in others


def test_a_silent_corruption_found_is_marked_and_labelled_with_its_suspects():
    from elastic.outputs.timeline_figure import _event_label

    summary = make_summary()
    summary["events"].append({"t": 12.0, "kind": "silent-corruption-found", "step": 20, "position": [0, 0, 0, 0],
                              "groups": [0], "suspects": [3], "named": True})
    legend = timeline_panels(summary)["events"]
    assert "silent corruption found (a spot check's replay, the integrity check)" in [
        text.get_text() for text in legend.get_texts()]
    assert _event_label(summary["events"][-1]) == "computed wrong: rank 3"


def test_each_leg_is_labelled_with_how_it_ended():
    from elastic.outputs.timeline import leg_ending

    labels = {text.get_text() for text in timeline_panels(resumed_run())["live"].texts}
    assert {"leg 1: preempted (SIGTERM)", "leg 2: preempted (SIGINT)"} <= labels

    sigint = [{"t": 5.0, "kind": "stop-requested", "signal": "SIGINT"}]
    assert leg_ending(RunSummary(exit="preempted: a second SIGINT stopped the run at once, before the step boundary",
                                  events=sigint)) == "preempted (SIGINT)"
    assert leg_ending(RunSummary(exit="preempted, final checkpoint missed (step 12): see the checkpoint-failed events",
                                  events=sigint)) == "preempted (SIGINT), final checkpoint missed (step 12)"
    assert leg_ending(RunSummary(exit="failed: RuntimeError: boom", events=sigint)) == "failed"
    assert leg_ending(RunSummary(exit="completed", events=[])) == "completed"
    assert leg_ending(RunSummary(events=[])) is None


def moe_summary() -> dict:
    """``make_summary``'s run as a mixture of experts' records it: expert layers 1, 3 and 10,
    layer 1 evening out over the run, 3 growing less even, 10 even throughout."""
    summary = make_summary(run="moe-run")
    for record in summary["steps"]:
        step = record["step"]
        record["expert_load"] = {"1": 1.0 + 2.0 / (1 + step), "3": 1.25 + 0.01 * step, "10": 1.0}
    return summary


def timeline_step(record: dict) -> TimelineStep:
    """A step's record in ``summary.json``, with the leg it is of (1 unless given), as the timeline reads it."""
    entry = {key: value for key, value in record.items() if key != "leg"}
    return TimelineStep.of_entry(StepEntry.model_validate(entry), record.get("leg", 1))


def test_expert_load_series_is_each_layers_load_by_step():
    from elastic.outputs.timeline import expert_load_series

    def series(records: list[dict]) -> dict:
        return expert_load_series([timeline_step(record) for record in records])

    summary = moe_summary()
    steps = [record["step"] for record in summary["steps"]]
    assert series(summary["steps"]) == {
        1: (steps, [1.0 + 2.0 / (1 + step) for step in steps]),
        3: (steps, [1.25 + 0.01 * step for step in steps]),
        10: (steps, [1.0] * len(steps)),  # layers in their order, not their names'
    }
    assert series(make_summary()["steps"]) == {}  # a dense model's

    # a resume goes back to its checkpoint's step: the step done again counts as done last
    resumed = [
        {"step": 0, "t": 1.0, "leg": 1, "expert_load": {"1": 2.0, "10": 3.0}},
        {"step": 1, "t": 2.0, "leg": 1, "expert_load": {"1": 1.5, "10": 2.5}},
        {"step": 1, "t": 9.0, "leg": 2, "expert_load": {"1": 1.25, "10": 2.0}},
        {"step": 2, "t": 10.0, "leg": 2, "expert_load": {"1": 1.125}},  # a layer a step did not record
    ]
    assert series(resumed[::-1]) == {1: ([0, 1, 2], [2.0, 1.25, 1.125]), 10: ([0, 1], [3.0, 2.0])}


def test_the_timeline_draws_each_expert_layers_load_for_a_mixture_of_experts_alone():
    from elastic.outputs.timeline import expert_load_series

    summary = moe_summary()
    panels = timeline_panels(summary)
    panel = panels["expert"]
    assert panel is not None
    expected = expert_load_series(timeline_step(record) for record in summary["steps"])
    layer_lines = {line.get_label(): line for line in panel.get_lines() if line.get_label().startswith("layer ")}
    assert list(layer_lines) == ["layer 1", "layer 3", "layer 10"]  # one line per layer
    for layer, (steps, loads) in expected.items():
        line = layer_lines[f"layer {layer}"]
        assert list(line.get_xdata()) == steps and list(line.get_ydata()) == loads
    [even] = [line for line in panel.get_lines() if line.get_label() == "even"]
    assert set(even.get_ydata()) == {1.0}  # across the panel at 1
    assert panel.get_ylim()[0] == 1.0 and panel.get_ylim()[1] > 3.0
    assert {text.get_text() for text in panel.get_legend().get_texts()} == {*layer_lines, "even"}
    assert panel.get_xlabel() == "step"

    dense = timeline_panels(make_summary())
    assert dense["expert"] is None  # a dense run's timeline is as it was: no panel more
    assert len(dense["axes"]) == len(panels["axes"]) - 1 == 6


def test_the_report_prints_what_crossed_groups_and_the_diloco_rounds(tmp_path, capsys):
    summary = make_summary(n_steps=8)
    for entry in summary["steps"]:
        outer = entry["step"] % 4 == 3
        entry.update(cross_group_bytes=1_000_000 if outer else 1_000, outer_step=outer)
    assert main([str(write_run(tmp_path, summary)), "--output", str(tmp_path / "t.png")]) == 0
    steps = len(summary["steps"])
    rounds = sum(entry["outer_step"] for entry in summary["steps"])
    total = sum(entry["cross_group_bytes"] for entry in summary["steps"])
    assert (f"across groups: {total / 1e6:.2f} MB over {steps} committed steps, {total / steps / 1e3:.1f} kB a step; "
            f"{rounds} DiLoCo outer steps\n") in capsys.readouterr().out
    # the learners lost inside rounds: a round redone, two learners dropped with their samples
    summary["events"] += [{"t": 1.0, "kind": "round-redone", "step": 4, "groups": [1], "rolled_back_steps": 2,
                           "seconds": 0.1},
                          {"t": 2.0, "kind": "learner-dropped", "step": 5, "groups": [0, 2], "round_start": 4,
                           "returned_samples": 12}]
    (tmp_path / "lost").mkdir()
    assert main([str(write_run(tmp_path / "lost", summary)), "--output", str(tmp_path / "t.png")]) == 0
    assert f"{rounds} DiLoCo outer steps (1 redone, 2 learners dropped, 12 samples returned)" in capsys.readouterr().out
