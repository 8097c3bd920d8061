"""The config against the cluster it runs on, once Ray is up: the device resolved, the
minimum layout placeable (or refused before any actor starts), and what will wait for room
said in one line."""

from __future__ import annotations

from elastic.setup.config import TrainConfig
from elastic.setup.errors import ConfigError


def spelled_product(factors: dict[str, int]) -> str:
    """``pp x shard x tp = 2 x 2 x 2``: named factors, then their values."""
    return f"{' x '.join(factors)} = {' x '.join(map(str, factors.values()))}"


def on_cluster(config: TrainConfig, cluster_resources: dict[str, float]) -> TrainConfig:
    """The config with its device resolved against the cluster it runs on."""
    scaling = config.scaling.on_cluster(cluster_resources.get("GPU", 0.0))
    return config.model_copy(update={"scaling": scaling})


def groups_beyond_capacity(config: TrainConfig, cluster_resources: dict[str, float]) -> str | None:
    """What to warn of when fewer than ``scaling.max_groups`` groups fit the cluster: the others
    are asked for and wait for room, silently, the whole run; None when they all fit."""
    scaling = config.scaling
    for resource, per_rank in scaling.per_rank_resources():
        available = cluster_resources.get(resource, 0.0)
        fit = int(available / (per_rank * scaling.topology.ranks_per_group) + 1e-9)
        if fit < scaling.max_groups:
            group = spelled_product(scaling.topology.group_dimensions())
            return (f"scaling.max_groups = {scaling.max_groups} groups of {group} = "
                    f"{scaling.topology.ranks_per_group} ranks, "
                    f"but the cluster has room for "
                    f"{fit} ({available:g} {resource} at {resource.lower()}s_per_rank={per_rank:g}): "
                    f"the other {scaling.max_groups - fit} wait for capacity, started only if the cluster grows; "
                    f"--groups {max(fit, scaling.min_groups)} trains on what is here")
    return None


def spares_beyond_capacity(config: TrainConfig, cluster_resources: dict[str, float]) -> str | None:
    """What to warn of when ``scaling.spares`` cannot all start beside the groups the run
    wants (they would wait for room, silently, the whole run); None when they fit."""
    scaling = config.scaling
    if not scaling.spares:
        return None
    ranks = scaling.max_groups * scaling.topology.ranks_per_group
    for resource, per_rank in scaling.per_rank_resources():
        room = int((cluster_resources.get(resource, 0.0) - ranks * per_rank) / per_rank + 1e-9)
        if room < scaling.spares:
            return (f"scaling.spares = {scaling.spares}, but beside {ranks} ranks at {resource.lower()}s_per_rank="
                    f"{per_rank:g} the cluster has room for {max(room, 0)} ({cluster_resources.get(resource, 0.0):g} "
                    f"{resource}); the others start only if the cluster grows")
    return None


def check_capacity(config: TrainConfig, cluster_resources: dict[str, float]) -> None:
    """Fail before any actor starts if the minimum layout cannot be placed, or placed where it
    cannot compute as configured."""
    scaling = config.scaling
    if config.compute.float8 and scaling.device != "cuda":
        raise ConfigError("compute.float8: the ranks train on CPU (scaling.device resolved to cpu); float8 "
                          "training needs GPUs of compute capability 8.9 or later (H100, L40S, ...); set "
                          "compute.float8 = false or run on such GPUs")
    if config.compute.offload and scaling.device == "cuda" and scaling.max_groups > 1:
        raise ConfigError(f"compute.offload with scaling.max_groups={scaling.max_groups} on GPUs: the groups sum "
                          "their gradients over NCCL on the device, and offloaded gradients live on the host; train "
                          "one group (scaling.max_groups = 1) or without offload")
    needed_ranks = scaling.min_groups * scaling.topology.ranks_per_group
    for resource, per_rank in scaling.per_rank_resources():
        available = cluster_resources.get(resource, 0.0)
        needed = needed_ranks * per_rank
        if needed > available + 1e-9:
            dimensions = {"min_groups": scaling.min_groups, **scaling.topology.group_dimensions()}
            raise ConfigError(
                f"scaling: {spelled_product(dimensions)} "
                f"= {needed_ranks} ranks need {needed:g} {resource} at "
                f"{resource.lower()}s_per_rank={per_rank:g}, but the cluster has {available:g}; "
                f"lower the layout or {resource.lower()}s_per_rank, or add nodes"
            )
