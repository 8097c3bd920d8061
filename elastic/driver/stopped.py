"""The error that ends a run the driver's decisions cannot carry on: the group keeper's, the
state sources' and the controller's alike."""


class TrainingStopped(RuntimeError):
    """The job cannot go on (below minimum, no live peer, recoveries exhausted)."""
