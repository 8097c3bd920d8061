"""What a run shows and leaves behind: Prometheus metrics (`metrics`), experiment trackers
(`loggers`) and the run's report and timeline (`report`).
"""
