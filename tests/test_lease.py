"""One driver per run: the lease protocol on a fake clock (local storage and a loopback S3
server), the catalog's generation marks, and a second driver refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import s3fs

from checkpointing.catalog import CheckpointCatalog
from checkpointing.lease import (
    LeaseCorrupt,
    LeaseDirectory,
    LeaseHeld,
    LeaseLost,
    LeaseRecord,
    LeaseUnsafe,
    RunLease,
    break_lease,
    lease_url,
    process_identity,
)
from checkpointing.storage import StorageOptions
from elastic.cli import main as cli_main
from elastic.trainer import ElasticTrainer
from tests.fake_fleet import FakeClock
from tests.tiny import tiny_config


# A lease's times are the wall clock's (its records name them in UTC).
NOW = 1_800_000_000.0


@pytest.fixture(params=["local", "s3"])
def run_url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "run"), StorageOptions()
    else:
        server = request.getfixturevalue("s3_server")
        yield server.url("runs", "run"), StorageOptions(endpoint_url=server.endpoint_url)


def test_a_second_driver_is_refused_naming_the_holder_until_the_lease_ends(run_url):
    url, options = run_url
    clock = FakeClock(NOW)
    first = RunLease(url, options, ttl_s=60, holder="head-0 pid 7", clock=clock)
    assert first.acquire() == 1
    second = RunLease(url, options, ttl_s=60, holder="head-1 pid 9", clock=clock)
    with pytest.raises(LeaseHeld, match=r"head-0 pid 7 \(lease generation 1\), until .* UTC \(in 60 s\)"):
        second.acquire()

    clock.now += 30
    first.renew()  # a live driver keeps it
    clock.now += 59
    with pytest.raises(LeaseHeld, match=r"in 1 s"):
        second.acquire()

    first.release()  # a driver that ends hands the run over at once
    assert second.acquire() == 2


def test_a_dead_drivers_lease_expires_and_the_next_driver_takes_over(run_url):
    url, options = run_url
    clock = FakeClock(NOW)
    RunLease(url, options, ttl_s=60, holder="dead", clock=clock).acquire()  # never renewed, never released
    clock.now += 61
    assert RunLease(url, options, ttl_s=60, holder="next", clock=clock).acquire() == 2


def test_generations_past_eight_digits_stay_the_newest(run_url):
    url, options = run_url
    clock = FakeClock(NOW)
    LeaseDirectory(lease_url(url), options).create(LeaseRecord(99_999_999, "old", clock.now - 1, released=True))
    assert RunLease(url, options, ttl_s=60, holder="next", clock=clock).acquire() == 100_000_000
    with pytest.raises(LeaseHeld, match="next"):
        RunLease(url, options, ttl_s=60, holder="third", clock=clock).acquire()


def test_of_two_drivers_racing_for_one_generation_exactly_one_wins(run_url, monkeypatch):
    url, options = run_url
    clock = FakeClock(NOW)
    winner = RunLease(url, options, ttl_s=60, holder="winner", clock=clock)
    loser = RunLease(url, options, ttl_s=60, holder="loser", clock=clock)
    assert winner.acquire() == 1
    listings = []
    listing = LeaseDirectory.generations

    def stale_first(records):  # the loser listed the leases before the winner's create landed
        listings.append(records.root)
        return [] if len(listings) == 1 else listing(records)

    monkeypatch.setattr(LeaseDirectory, "generations", stale_first)
    with pytest.raises(LeaseHeld, match="winner"):
        loser.acquire()  # its exclusive create of generation 1 fails; it looks again and is refused
    assert len(listings) == 2
    assert loser.generation is None


def test_a_driver_whose_lease_was_taken_commits_and_deletes_nothing(tmp_path):
    clock = FakeClock(NOW)
    url, options = str(tmp_path / "run"), StorageOptions()
    old = RunLease(url, options, ttl_s=60, holder="old", clock=clock)
    old.acquire()
    clock.now += 61  # the old driver stalled past its expiry (a partition, a frozen VM)
    RunLease(url, options, ttl_s=60, holder="new", clock=clock).acquire()
    with pytest.raises(LeaseLost, match="expired"):
        old.renew()
    with pytest.raises(LeaseLost):
        old.ensure_held()
    old.release()  # a lost lease is not the old driver's to release
    record = json.loads((tmp_path / "run" / "lease" / "00000002.json").read_text())
    assert record["holder"] == "new" and not record["released"]


def test_a_renewal_that_finds_a_newer_generation_loses_the_run(tmp_path):
    clock = FakeClock(NOW)
    url, options = str(tmp_path / "run"), StorageOptions()
    old = RunLease(url, options, ttl_s=60, holder="old", clock=clock)
    old.acquire()
    (tmp_path / "run" / "lease" / "00000002.json").write_text(
        json.dumps({"generation": 2, "holder": "usurper", "expires_at": clock.now + 60, "released": False}))
    with pytest.raises(LeaseLost, match="generation 2 was taken by usurper"):
        old.renew()


def dead_pid() -> int:
    """The id of a process of this host that ran and was reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def identity_of(pid: int, started: str | None = None) -> str:
    """A process identity on this machine and process table: ``pid``'s, or one with its id
    started at ``started`` (a process long gone, or a reused id)."""
    boot, table, _, own_start = process_identity().split("|")
    return f"{boot}|{table}|{pid}|{own_start if started is None else started}"


def test_a_driver_that_sees_the_holders_process_gone_takes_the_run_without_waiting_for_its_lease(tmp_path):
    """The holder died holding a live lease (no release): a next driver on its machine and in
    its process table finds its process gone (no such id, an id reused by a process started
    later, a zombie) and takes the run at once; one elsewhere, or finding the process there,
    waits for the lease as before."""
    url, options, clock = str(tmp_path / "run"), StorageOptions(), FakeClock(NOW)
    elsewhere = identity_of(dead_pid()).replace("|pid:", "|other:")  # another container's table
    alive = process_identity(os.getppid())
    for generation, process in enumerate([elsewhere, alive, ""], start=1):
        write_record(url, options, generation, LeaseRecord(generation, f"holder {generation}", NOW + 60, False,
                                                           process).encode())
        with pytest.raises(LeaseHeld, match=f"holder {generation}"):
            RunLease(url, options, ttl_s=60, holder="next", clock=clock).acquire()
    for generation, process in [(4, identity_of(dead_pid())), (6, identity_of(os.getppid(), started="1"))]:
        gone = LeaseRecord(generation, "the dead driver", NOW + 60, False, process)
        write_record(url, options, generation, gone.encode())
        next_driver = RunLease(url, options, ttl_s=60, holder="next", clock=clock)
        assert next_driver.acquire() == generation + 1 and next_driver.taken_from == gone
        record = LeaseDirectory(lease_url(url), options).read(generation + 1)
        assert (record.holder, record.process) == ("next", process_identity())
        with pytest.raises(LeaseHeld, match="next"):  # this driver is alive: no one takes the run from it
            RunLease(url, options, ttl_s=60, holder="third", clock=clock).acquire()

    zombie = subprocess.Popen(["true"])
    try:
        identity = process_identity(zombie.pid) or identity_of(zombie.pid)
        deadline = time.monotonic() + 10
        while not LeaseRecord(8, "z", NOW + 60, False, identity).holder_gone():
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
    finally:
        zombie.wait()


def test_an_older_drivers_record_without_its_process_is_waited_for(tmp_path):
    url, options, clock = str(tmp_path / "run"), StorageOptions(), FakeClock(NOW)
    write_record(url, options, 1, json.dumps({"generation": 1, "holder": "old", "expires_at": NOW + 60,
                                              "released": False}).encode())
    with pytest.raises(LeaseHeld, match="old"):
        RunLease(url, options, ttl_s=60, holder="next", clock=clock).acquire()


def write_record(url: str, options: StorageOptions, generation: int, data: bytes) -> None:
    fs, path = options.filesystem(f"{url}/lease/{generation:08d}.json")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


@pytest.mark.parametrize("data, problem", [
    (b"", "(empty)"),  # a crash between create and write, on a store without atomic writes
    (json.dumps({"generation": 1, "holder": "crashed", "expires_at": 1.0}).encode(), "missing or mistyped: released"),
    (b"\x00\xff{garbage", "not JSON"),
])
def test_an_unreadable_record_is_named_in_one_line_and_break_lease_recovers_the_run(run_url, data, problem):
    url, options = run_url
    clock = FakeClock(NOW)
    RunLease(url, options, ttl_s=60, holder="crashed", clock=clock).acquire()
    write_record(url, options, 1, data)
    next_driver = RunLease(url, options, ttl_s=60, holder="next", clock=clock)
    with pytest.raises(LeaseCorrupt) as refused:
        next_driver.acquire()  # every retry would fail the same way, until the record is dealt with
    message = str(refused.value)
    assert f"{url}/lease/00000001.json is unreadable" in message and problem in message
    assert "--break-lease" in message and "\n" not in message
    assert next_driver.generation is None

    assert break_lease(url, options, clock=clock) == 2  # the next generation, released
    assert next_driver.acquire() == 3
    fs, root = options.filesystem(f"{url}/lease")
    assert sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)) == ["00000002.json", "00000003.json"]


def test_break_lease_never_breaks_a_live_lease(tmp_path):
    url, options, clock = str(tmp_path / "run"), StorageOptions(), FakeClock(NOW)
    holder = RunLease(url, options, ttl_s=60, holder="alive", clock=clock)
    holder.acquire()
    with pytest.raises(LeaseHeld, match="alive"):
        break_lease(url, options, clock=clock)
    holder.renew()  # still its run


def test_a_crash_mid_renewal_leaves_the_previous_record_whole(tmp_path, monkeypatch):
    url, options, clock = str(tmp_path / "run"), StorageOptions(), FakeClock(NOW)
    lease = RunLease(url, options, ttl_s=60, holder="renewing", clock=clock)
    lease.acquire()
    before = (tmp_path / "run" / "lease" / "00000001.json").read_bytes()

    def crash(descriptor):
        raise KeyboardInterrupt("the process dies while the new record is being written")

    clock.now += 20
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", crash)
        with pytest.raises(KeyboardInterrupt):
            lease.renew()
    assert os.listdir(tmp_path / "run" / "lease") == ["00000001.json"]  # no temporary file left behind
    assert (tmp_path / "run" / "lease" / "00000001.json").read_bytes() == before
    lease.renew()
    assert json.loads((tmp_path / "run" / "lease" / "00000001.json").read_text())["expires_at"] == clock.now + 60


def test_a_renewal_that_finds_its_record_overwritten_loses_the_run(run_url):
    url, options = run_url
    clock = FakeClock(NOW)
    first = RunLease(url, options, ttl_s=60, holder="first", clock=clock)
    first.acquire()
    # what a store that ignores If-None-Match lets a racing driver do: create generation 1 over it
    write_record(url, options, 1, json.dumps(
        {"generation": 1, "holder": "second", "expires_at": clock.now + 60, "released": False}).encode())
    with pytest.raises(LeaseLost, match="generation 1 was taken over by second"):
        first.renew()
    with pytest.raises(LeaseLost):
        first.ensure_held()
    first.release()  # not its record to end
    fs, path = options.filesystem(f"{url}/lease/00000001.json")
    assert json.loads(fs.cat_file(path))["holder"] == "second"


def test_a_store_that_ignores_if_none_match_is_refused_before_anything_is_written(s3_server, monkeypatch):
    original = s3fs.S3FileSystem._pipe_file

    async def ignoring_the_condition(self, path, data, mode="overwrite", **kwargs):
        return await original(self, path, data, **kwargs)  # as a server that drops If-None-Match

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", ignoring_the_condition)
    s3fs.S3FileSystem.clear_instance_cache()  # instances bind their methods when made
    url, options = s3_server.url("runs", "run"), StorageOptions(endpoint_url=s3_server.endpoint_url)
    with pytest.raises(LeaseUnsafe, match=r"ignores exclusive creates \(If-None-Match\).*two drivers could both"):
        RunLease(url, options, ttl_s=60, holder="first").acquire()
    fs, root = options.filesystem(f"{url}/lease")
    assert not fs.exists(root) or fs.ls(root, detail=False) == []  # no record, and the probe removed


def test_partials_are_pruned_by_generation_and_commits_carry_it(tmp_path):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10, generation=2)
    older = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10, generation=1)
    newer = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10, generation=3)
    older.prepare(5)  # a partial of the driver this one took over from
    catalog.prepare(10)  # this driver's own failed save
    catalog.prepare(15)  # this driver's save in flight
    newer.prepare(20)  # a save of the driver that took the run from this one
    catalog.prepare(25)
    manifest = catalog.commit(25, {"epoch": 0, "position": 0}, {"shard": 1}, "h",
                              {"__0_0.distcp": (1, "0" * 64)}, timings={})
    assert manifest.lease_generation == 2
    assert catalog.prune(writing=15) == [5, 10]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-00000015", "step-00000020", "step-00000025"]


def test_a_second_driver_exits_at_once_before_ray_or_any_actor_starts(tmp_path, capsys):
    config = tiny_config(tmp_path, run_name="taken")
    holder = RunLease(str(tmp_path / "runs" / "taken"), StorageOptions(), ttl_s=600, holder="the first driver")
    holder.acquire()
    with pytest.raises(LeaseHeld, match="the first driver"):
        ElasticTrainer(config).fit()
    assert not (tmp_path / "runs" / "taken" / "summary.json").exists(), "the first driver's summary is its own"

    code = cli_main(["train", "--quiet", "--storage", str(tmp_path / "runs"), "--run-name", "taken"])
    assert code == 1
    assert "another driver holds this run: the first driver" in capsys.readouterr().err


def test_a_driver_that_finds_the_holder_dead_on_its_host_trains_at_once_and_says_so(ray_cluster, tmp_path):
    config = tiny_config(tmp_path, run_name="orphaned", steps=4)
    url = str(tmp_path / "runs" / "orphaned")
    write_record(url, StorageOptions(), 1, LeaseRecord(1, "the killed driver", time.time() + 600, False,
                                                      identity_of(dead_pid())).encode())
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    [lost] = [event for event in result.summary["events"] if event["kind"] == "driver-lost"]
    assert lost["holder"] == "the killed driver" and 500 < lost["lease_left_s"] <= 600
