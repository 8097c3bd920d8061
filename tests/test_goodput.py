"""The time ledger on a fake clock: parts always add up to the wall time."""

from elastic.core.goodput import TimeLedger


def test_nested_timings_charge_each_second_once():
    now = [0.0]
    ledger = TimeLedger(lambda: now[0])
    with ledger.timing("recovery"):
        now[0] += 1
        with ledger.timing("checkpoint_stall"):
            now[0] += 2
        now[0] += 3
    ledger.charge("committed", 0.5)
    now[0] += 1
    breakdown = ledger.breakdown()
    assert breakdown["recovery"] == 4 and breakdown["checkpoint_stall"] == 2 and breakdown["committed"] == 0.5
    assert breakdown["idle"] == 0.5
    assert sum(v for k, v in breakdown.items() if k != "wall_s") == breakdown["wall_s"] == 7
    assert ledger.goodput() == 0.5 / 7
