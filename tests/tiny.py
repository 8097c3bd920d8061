"""Tiny job configs for tests: a step is tens of milliseconds."""

from elastic.setup.config import DAY_S
from elastic.setup.preflight import build_config


# A hang found within seconds of tiny steps (the defaults are a real run's): for tests that
# inject hangs and kills.
FAST_DETECTION = {"fault_tolerance__min_deadline_s": 3.0, "fault_tolerance__deadline_factor": 4.0}


def tiny_config(tmp_path, *, groups=1, shard=1, tp=1, steps=20, **overrides):
    values = {
        "run_name": overrides.pop("run_name", "test"),
        "storage": str(tmp_path / "runs"),
        "steps": steps,
        "global_batch": 8,
        "micro_batch": 2,
        "seed": 3,
        "scaling": {"min_groups": overrides.pop("min_groups", 1), "max_groups": groups, "shard": shard, "tp": tp,
                    "cpus_per_rank": 0.25},
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64},
        "data": {"seq_len": 32, "corpus_tokens": 40_000},
        # Bounds on how long starting a rank may take, not assertions: generous, so that a
        # machine busy with other work starts its ranks late rather than fails the test.
        "fault_tolerance": {"first_step_deadline_s": 120, "collective_timeout_s": 20,
                            "capacity_timeout_s": overrides.pop("capacity_timeout_s", 300)},
    }
    if overrides.get("compute__compile"):
        # A rank compiles its blocks in its first step, and again at a later one where a guard
        # fails: minutes of a loaded machine, its peers waiting in a collective meanwhile. A rank
        # killed as hung mid-compile would leave a truncated library in the compiler's cache,
        # which the next try loads. No deadline, then: pytest's timeout bounds a hang.
        values["fault_tolerance"] |= {"first_step_deadline_s": DAY_S, "min_deadline_s": DAY_S,
                                      "collective_timeout_s": DAY_S}
    for key, value in overrides.items():
        section, _, leaf = key.partition("__")
        if leaf:
            values.setdefault(section, {})[leaf] = value
        else:
            values[key] = value
    return build_config(values)
