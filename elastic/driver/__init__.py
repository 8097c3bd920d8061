"""The driver's control loop: the run's state machine (`controller`), groups into and out of
the quorum (`group_keeper`), where a joining group's state comes from (`state_sources`),
watching a run's record streams (`segment_watch`), evaluations, the ranks' final reports and the
drain after a failure (`outcome_collector`), the committed progress and its records
(`progress`, `records`), recovery timing, checkpoint commits and the warm spares.

It decides through `elastic.core` and acts through `elastic.fleet`'s interface; it imports
neither Ray nor torch (`tests/test_core.py`).
"""
