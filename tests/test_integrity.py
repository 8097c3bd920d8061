"""The replicas' integrity check: the verdict over fingerprints (pure), the fingerprints
themselves (torch, one process), and, on real Ray actors, a flipped bit found, healed, and
the run's losses equal to a clean run's."""

import pytest
import torch

from elastic import ElasticTrainer
from elastic.core.events import EventKind
from elastic.core.integrity import NAMED_TENSORS, check_due, compare, suspect_groups
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import FAST_DETECTION, tiny_config
from workers.integrity import fingerprints, flip_bit, state_tensors

NAMES = [f"tensor{index}" for index in range(8)]


def test_identical_fingerprints_are_no_finding():
    assert compare(10, (0, 0), {0: (1, 2), 1: (1, 2), 2: (1, 2)}, NAMES) is None


def test_the_groups_outside_a_majority_are_the_suspects():
    found = compare(10, (1, 0), {0: (1, 2), 1: (1, 9), 2: (1, 2)}, NAMES)
    assert (found.step, found.position, found.suspects, found.majority, found.tensors) == (
        10, (1, 0), (1,), (0, 2), ("tensor1",))


@pytest.mark.parametrize("fingerprints_by_group", [
    {0: (1,), 1: (2,)},  # two groups: either may be the odd one
    {0: (1,), 1: (1,), 2: (2,), 3: (2,)},  # a tie
    {0: (1,), 1: (2,), 2: (3,)},  # all differ
])
def test_without_a_majority_every_group_is_suspect(fingerprints_by_group):
    found = compare(5, (0, 0), fingerprints_by_group, NAMES)
    assert found.suspects == tuple(sorted(fingerprints_by_group)) and found.majority == ()


def test_a_finding_names_the_first_differing_tensors_only():
    found = compare(5, (0, 0), {0: tuple(range(8)), 1: tuple(range(8)), 2: tuple(-1 for _ in range(8))}, NAMES)
    assert found.tensors == tuple(NAMES[:NAMED_TENSORS])


def test_the_suspects_of_several_positions_add_up():
    first = compare(5, (0, 0), {0: (1,), 1: (2,), 2: (1,)}, NAMES)
    second = compare(5, (1, 0), {0: (3,), 1: (3,), 2: (4,)}, NAMES)
    assert suspect_groups([first, second]) == {1, 2}


def test_a_check_is_due_every_n_steps_from_step_0_and_never_with_0():
    assert [step for step in range(25) if check_due(step, 10)] == [0, 10, 20]
    assert not any(check_due(step, 0) for step in range(25))


def trained(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8, dtype=dtype)).sum().backward()
    optimizer.step()
    return model, optimizer


def fingerprint(model, optimizer):
    return fingerprints([tensor for _, tensor in state_tensors(model, optimizer)], torch.device("cpu")).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_states_fingerprint_equal_and_one_flipped_bit_changes_only_its_tensor(dtype):
    model, optimizer = trained(dtype)
    replica_model, replica_optimizer = trained(dtype)
    before = fingerprint(model, optimizer)
    assert before == fingerprint(replica_model, replica_optimizer)
    last = list(model.parameters())[-1]
    original = last.detach().clone()
    flip_bit(model)
    after = fingerprint(model, optimizer)
    changed = [name for (name, _), old, new in zip(state_tensors(model, optimizer), before, after) if old != new]
    assert changed == ["1.bias"]
    # one element, one bit: the value is off, and nothing else moved
    differs = (last.detach() != original).flatten().nonzero().flatten().tolist()
    assert differs == [0]
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[last.element_size()]
    xor = last.detach().flatten()[:1].view(bits) ^ original.flatten()[:1].view(bits)
    assert bin(int(xor.item()) & 0xFFFFFFFF).count("1") == 1


def test_the_fingerprint_of_a_tensor_does_not_depend_on_how_its_sum_is_split():
    tensor = torch.randn(1000)
    whole = fingerprints([tensor], torch.device("cpu")).item()
    halves = fingerprints([tensor[:500], tensor[500:]], torch.device("cpu")).tolist()
    assert whole == sum(halves) % 2**32


def integrity_events(summary):
    return [event for event in summary["events"] if event["kind"] == EventKind.INTEGRITY_MISMATCH]


def test_a_flipped_bit_is_found_and_healed_from_the_majority_and_the_losses_equal_a_clean_run(ray_cluster, tmp_path):
    """The bit flips in group 1 as step 6 begins, and step 6 begins with a check: the step is
    discarded before the corrupt state reaches any gradient sum, group 1 leaves to heal from
    the others, and every committed step equals the clean run's."""
    steps = 10
    config = tiny_config(tmp_path, groups=3, shard=1, steps=steps, integrity__every=3,
                         fault_tolerance__inject="flip:rank=1,step=6", **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    summary = result.summary
    assert result.ok, result.exit
    [found] = integrity_events(summary)
    assert (found["step"], found["suspects"], found["majority"]) == (6, [1], [0, 2])
    assert found["tensors"][0].endswith("weight") or found["tensors"][0].endswith("bias")
    [discarded] = [event for event in summary["events"] if event["kind"] == EventKind.STEP_DISCARDED]
    assert (discarded["cause"], discarded["broken_groups"]) == ("integrity-mismatch", [1])
    # group 1 rebuilds and heals from the majority when it is back (the run may end first:
    # the others go on without it)
    healed = [event for event in summary["events"] if event["kind"] == EventKind.GROUP_HEALED]
    assert all(event["group"] == 1 and event["source_group"] in (0, 2) for event in healed)
    assert [event for event in summary["events"] if event["kind"] == EventKind.RANK_EVICTED] == []
    assert [record["step"] for record in summary["steps"]] == list(range(steps))
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5


def test_with_two_groups_a_flipped_bit_rolls_both_back_to_a_verified_state(ray_cluster, tmp_path):
    steps = 10
    config = tiny_config(tmp_path, groups=2, shard=1, steps=steps, integrity__every=3,
                         fault_tolerance__inject="flip:rank=0,step=4", **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    summary = result.summary
    assert result.ok, result.exit
    [found] = integrity_events(summary)
    assert (found["step"], found["suspects"], found["majority"]) == (6, [0, 1], [])
    [restart] = [event for event in summary["events"] if event["kind"] == EventKind.RESTORED_INITIAL_STATE]
    assert restart["rolled_back_steps"] == 6  # no checkpoint yet: the seed's state is the verified one
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5


def test_a_flip_between_checks_rolls_every_group_back_to_the_verified_copy_in_memory(ray_cluster, tmp_path):
    """The bit flips in group 0 as step 4 begins; steps 4 and 5 sum its gradients into every
    group, and the check at step 6 finds it. Every rank holds its copy of step 3, the last
    verified: every group goes back to it before it takes samples again, and the losses are
    the clean run's."""
    steps = 9
    config = tiny_config(tmp_path, groups=3, shard=1, steps=steps, integrity__every=3, checkpoint__memory_every=3,
                         fault_tolerance__inject="flip:rank=0,step=4", **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    summary = result.summary
    assert result.ok, result.exit
    [found] = integrity_events(summary)
    assert (found["step"], found["suspects"], found["majority"]) == (6, [0], [1, 2])
    [restored] = [event for event in summary["events"] if event["kind"] == EventKind.RESTORED_FROM_MEMORY]
    assert (restored["step"], restored["rolled_back_steps"]) == (3, 3)
    # the groups ready first restore it; one built later heals from them, or is still out at the
    # run's end (on a loaded machine its build can outlast the six steps left): no group takes
    # samples without the verified state
    healed = {event["group"] for event in summary["events"] if event["kind"] == EventKind.GROUP_HEALED}
    trained = {int(group) for record in summary["steps"][restored["step"]:]
               for group, samples in record["group_samples"].items() if samples}
    assert restored["groups"] and trained <= set(restored["groups"]) | healed, (trained, restored["groups"], healed)
    assert [record["step"] for record in summary["steps"]] == list(range(steps))  # the history after the rollback
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5
