"""What a rank's failed step points at: its own work, or its peers.

A rank knows where it failed, and the error's type and the code it came out of say what
failed; its text is never read. Four kinds, each a value of ``Failure``:

- ``OWN_IO``: reading its own data (the ``data`` phase, outside any collective);
- ``OWN_CODE``: raised by the user's own code itself: its innermost frame is the user's, and
  it is not a ``RuntimeError`` (what torch's kernels raise for a device's fault, a cuBLAS
  failure or host memory running out, from whatever line called them). A fresh process runs
  the same code into the same error;
- ``OWN_COMPUTE``: its own model, optimizer, device or memory otherwise;
- ``COLLECTIVE``: an error raised inside a collective with peers: the backend's own
  ``DistError`` types, any error that came out of c10d's collective code (gloo reports a
  dead peer as a plain ``RuntimeError`` from ``distributed_c10d`` or the functional
  collectives), ``CollectiveFailed`` from the step's wait on a cross-group collective, or ``VoteFailed``
  from the group's vote;
- ``RELEASED``: the driver or the step's deadline released it from waiting on peers, or its
  group's vote discarded a step whose cross-group sum failed on a peer.

The last two make the rank a victim, not a culprit: the driver looks for the rank that died,
hung or failed on its own.
"""

from __future__ import annotations

import os
import sysconfig
import traceback

import torch
import torch.distributed as dist

from elastic.core.protocol import Failure, Phase, RankOutcome, describe_error
from workers import TRAINER_PACKAGES


class CollectiveAborted(RuntimeError):
    """The driver gave up on this step while this rank waited for a peer."""


class CollectiveTimedOut(RuntimeError):
    """A peer did not join the cross-group all-reduce before the step's deadline."""


class HealFailed(RuntimeError):
    """A joining rank's copy of the state failed (``workers.catch_up``): it holds no state, and
    its group builds again (``Failure.NO_STATE``)."""


class CollectiveFailed(RuntimeError):
    """The cross-group all-reduce failed while this rank waited on it (a peer or the transport)."""


class StepInterrupted(RuntimeError):
    """The driver gave up on this step; the group stopped together between micro-batches."""


class StepDiscarded(RuntimeError):
    """The group's vote found that a peer's cross-group sum failed: every rank discards."""


class OuterStepFailed(RuntimeError):
    """A DiLoCo round's outer step failed (its cause: the pseudo-gradients' sum) after the
    round's last inner step was applied: the rank holds an update of no committed step, so its
    group is broken, builds again and takes the state anew."""


class VoteFailed(RuntimeError):
    """The group's vote itself failed (a peer died or hung in it): the group is broken."""


# Every collective torch issues from Python passes through one of these; an error raised
# while one of them is on the stack came from the collective (a peer, or the transport).
COLLECTIVE_CODE = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/_functional_collectives.py",
    "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
)


# The pipeline schedules wait on their stages' sends and receives themselves: an error raised
# by such a wait (the innermost frame) came from a peer stage. Not any frame of theirs: the
# stages' forward and backward, the user's model, run under them too.
PIPELINE_CODE = "torch/distributed/pipelining/"


def unwrapped(error: BaseException) -> BaseException:
    """The error a pipeline stage's forward or backward raised: torch's pipelining re-raises it
    as a ``RuntimeError`` of its own (``from`` the original), which names only the stage. A
    peer's death inside the stage's FSDP2 or TP collectives, or the user's own error, is what
    the original says."""
    while isinstance(error, RuntimeError) and error.__cause__ is not None:
        frames = traceback.extract_tb(error.__traceback__)
        if not (frames and PIPELINE_CODE in frames[-1].filename.replace("\\", "/")):
            break
        error = error.__cause__
    return error


def raised_in_collective(error: BaseException) -> bool:
    error = unwrapped(error)
    if isinstance(error, (dist.DistError, CollectiveFailed, VoteFailed)):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    paths = [frame.filename.replace("\\", "/") for frame in frames]
    if frames and PIPELINE_CODE in paths[-1] and ".wait()" in (frames[-1].line or ""):
        return True
    return any(path.endswith(COLLECTIVE_CODE) for path in paths)


# This trainer's packages lie side by side, this module's among them. Not each package's
# __file__: a folder named like one of them first on the path makes that a namespace package,
# which has none (and lies elsewhere).
_TRAINER_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

# Frames in these are not the user's: Python's own library, installed packages, torch and
# this trainer's packages (installed or not).
NOT_USER_CODE = tuple({os.path.realpath(path) + os.sep for key, path in sysconfig.get_paths().items()
                       if key in ("stdlib", "platstdlib", "purelib", "platlib")}
                      | {os.path.dirname(os.path.realpath(torch.__file__)) + os.sep}
                      | {os.path.join(_TRAINER_ROOT, name) + os.sep for name in TRAINER_PACKAGES})


def is_user_code(filename: str) -> bool:
    path = os.path.realpath(filename)
    # torch.compile's generated modules live in its cache directory: the compiler's, not the user's.
    return not (filename.startswith("<") or path.startswith(NOT_USER_CODE)
                or os.sep + "site-packages" + os.sep in path or os.sep + "torchinductor_" in path)


def user_frame(error: BaseException) -> str | None:
    """Where in the user's own code ``error`` was raised: the innermost frame outside the
    libraries, as ``file:line in function``; None when it came from no user code."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if is_user_code(frame.filename):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return None


def raised_by_user_code(error: BaseException) -> bool:
    """The user's code raised ``error`` itself (its innermost frame), and not as a
    ``RuntimeError``, which a device's or the allocator's fault in a torch call would be."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and is_user_code(frames[-1].filename) and not isinstance(error, RuntimeError)


def describe_failure(error: BaseException) -> str:
    """The error's type and message, and the frame in the user's code it came from."""
    error = unwrapped(error)
    frame = user_frame(error)
    return describe_error(error) if frame is None else f"{describe_error(error)} (at {frame})"


def classify(error: BaseException, phase: Phase) -> Failure:
    """``phase``: where the rank was (``data``, ``compute``, ``replicate``; see ``RankActivity``)."""
    error = unwrapped(error)
    if isinstance(error, OuterStepFailed) and error.__cause__ is not None:
        return classify(error.__cause__, phase)
    if isinstance(error, (CollectiveAborted, CollectiveTimedOut, StepInterrupted, StepDiscarded)):
        return Failure.RELEASED
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return Failure.OWN_COMPUTE
    if isinstance(error, HealFailed):
        return Failure.NO_STATE
    if raised_in_collective(error):
        return Failure.COLLECTIVE
    if phase == Phase.DATA:  # storage may recover; the data or the dataset's code will not
        return Failure.OWN_IO if isinstance(error, OSError) else Failure.OWN_DATA
    return Failure.OWN_CODE if raised_by_user_code(error) else Failure.OWN_COMPUTE


def failure_outcome(global_rank: int, step: int, error: BaseException, phase: Phase) -> RankOutcome:
    """The outcome of a step (or evaluation) that failed with ``error`` in ``phase``. The group's
    world is broken when a rank failed in its own work outside an agreed stop (its peers may
    wait for it in a collective of the group), or in the vote."""
    group_broken = (phase in (Phase.DATA, Phase.COMPUTE, Phase.STAGE_WAIT) and not isinstance(error, StepInterrupted)
                    or isinstance(unwrapped(error), (VoteFailed, OuterStepFailed)))
    return RankOutcome(global_rank, step, error=describe_failure(error), failure=classify(error, phase),
                       group_broken=group_broken)
