"""The one way the driver's decisions end a run before its last step."""


class TrainingStopped(RuntimeError):
    """The job cannot go on (below minimum, no live peer, recoveries exhausted)."""
