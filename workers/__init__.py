"""The rank processes' code: the actor, its step and what its failures point at."""

# The trainer's top-level packages, installed side by side.
TRAINER_PACKAGES = ("checkpointing", "elastic", "workers")
