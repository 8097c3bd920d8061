"""``elastic export``: a run's committed checkpoint as one consolidated safetensors file.

The checkpoint's model shards (FSDP and tensor-parallel pieces, in DCP's files) are read
into whole tensors in one process, with no process group and no code run from storage
(``rank_io.SafeReader``, ``SafeLoadPlanner``). Two layouts:

- ``native``: the model's own parameter names, loadable with ``load_state_dict`` by the model
  the run trained (``workers.model.Transformer`` for the reference model, whose
  ``ModelArgs`` go beside it in ``model_args.json``);
- ``huggingface`` (the reference model only): HuggingFace Llama's (Mixtral's, with experts)
  names and ``config.json``, loadable by ``LlamaForCausalLM.from_pretrained`` (or Mixtral's),
  converted by the table ``model.init_from`` reads with (``checkpointing.huggingface``).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Literal

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpointing.catalog import CheckpointCatalog, NoUsableCheckpoint
from checkpointing.huggingface import WEIGHTS_NAME, config_json, family_obstacle, huggingface_state, layout_of
from checkpointing.manifest import CorruptCheckpoint, signing_key_from_environment
from checkpointing.rank_io import SafeLoadPlanner, SafeReader
from checkpointing.safe_loading import load_metadata
from checkpointing.storage import StorageOptions
from elastic.setup.config import TrainConfig
from elastic.setup.errors import ConfigError
from workers.model import ModelArgs

MODEL_PREFIX = "model."  # the checkpoint holds {"model": ..., "optimizer": ...}, flattened


@dataclass(frozen=True)
class PassedOver:
    """A committed checkpoint of a later step than the one exported, and why it does not load."""

    step: int
    reason: str


@dataclass(frozen=True)
class Exported:
    step: int
    directory: str
    files: tuple[str, ...]
    parameters: int
    passed_over: tuple[PassedOver, ...] = ()  # newest first: an older step was written instead of these


def model_state(url: str, options: StorageOptions) -> dict[str, torch.Tensor]:
    """The checkpoint's model state as whole tensors, by the model's own parameter names."""
    fs, path = fsspec.core.url_to_fs(url, **options.for_url(url))
    with fs.open(f"{path}/.metadata", "rb") as stream:
        metadata = load_metadata(stream)
    state = {name.removeprefix(MODEL_PREFIX): torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for name, item in metadata.state_dict_metadata.items()
             if name.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata)}
    loaded = {"model": state}
    with warnings.catch_warnings():  # that one process reads it all is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(loaded, storage_reader=SafeReader(url, **options.for_url(url)), planner=SafeLoadPlanner(),
                 no_dist=True)
    return loaded["model"]


def reference_model_args(manifest_config: dict) -> ModelArgs:
    """The reference model's arguments as the run configured them (the manifest's record)."""
    from elastic.setup.hooks import model_args

    # at tp 1: the model alone, not the checks of the layout it trained at
    config = TrainConfig.model_validate({"model": manifest_config["model"], "scaling": {"tp": 1},
                                         "data": {"seq_len": manifest_config["data"]["seq_len"]}})
    return model_args(config)


def is_reference_model(state: dict[str, torch.Tensor], args: ModelArgs) -> bool:
    from workers.model import Transformer

    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    return set(state) == set(expected) and all(state[name].shape == expected[name].shape for name in expected)


def huggingface_model(state: dict[str, torch.Tensor], args: ModelArgs,
                      max_position_embeddings: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The reference model's state under HuggingFace Llama's names, and its ``config.json``.
    ``max_position_embeddings``: the ``model`` section's, the source model's when the run
    started from one (``ModelArgs`` hold only the length the run trained on)."""
    fields = asdict(args) | {"max_position_embeddings": max_position_embeddings}
    return huggingface_state(state, layout_of(fields)), config_json(fields, args.max_seq_len)


def later_steps_passed_over(catalog: CheckpointCatalog, exported_step: int) -> tuple[PassedOver, ...]:
    """The committed checkpoints of steps after ``exported_step`` that fail verification, newest
    first: ``find`` passes over them without a word, and the user who asked for the newest
    must hear which step was written instead and why. A later step that verifies is left out:
    it is not the newest commit (the run resumed from an earlier checkpoint and went on)."""
    passed_over = []
    for step in sorted(catalog.committed_steps(), reverse=True):
        if step <= exported_step:
            break
        try:
            catalog.find(step)
        except NoUsableCheckpoint as error:
            passed_over.append(PassedOver(step, str(error)))
    return tuple(passed_over)


def export_checkpoint(run: str, output: str, step: int | None = None,
                      layout: Literal["native", "huggingface"] = "native", dtype: str | None = None,
                      options: StorageOptions | None = None, tokenizer: str | None = None) -> Exported:
    """Write the run's newest verified checkpoint (or ``step``'s, never another) to the local
    directory ``output``; ``Exported.passed_over`` names the later ones that fail verification.
    ``dtype``: a torch dtype's name to convert floating tensors to (default: as stored, float32).
    ``tokenizer``: a HuggingFace tokenizer (a Hub name or a directory) to save beside the
    weights, so the directory loads whole; checked before anything is written."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("elastic export needs safetensors: pip install 'elastic-trainer[export]'") from None
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"--output {output}: a file is there; give a directory (new, or one to write into)")
    if tokenizer is not None:
        from elastic.prepare import HuggingFaceTokenizer

        tokenizer = HuggingFaceTokenizer.load(tokenizer).tokenizer
    options = options or StorageOptions()
    catalog = CheckpointCatalog(run, options, every=1, keep=1, signing_key=signing_key_from_environment())
    checkpoint = catalog.find(step)
    passed_over = later_steps_passed_over(catalog, checkpoint.step) if step is None else ()
    try:
        state = model_state(checkpoint.url, options)
    except (CheckpointException, CorruptCheckpoint) as error:
        failures = getattr(error, "failures", None)
        first = str(next(iter(failures.values()))) if failures else str(error)
        raise ConfigError(f"{checkpoint.url} does not load: {' '.join(first.split())[:400]}; nothing was "
                          "exported") from None
    if dtype is not None:
        state = {name: tensor.to(getattr(torch, dtype)) if tensor.is_floating_point() else tensor
                 for name, tensor in state.items()}
    args = reference_model_args(checkpoint.manifest.config) if checkpoint.manifest.config.get("model") else None
    reference = args is not None and is_reference_model(state, args)
    os.makedirs(output, exist_ok=True)
    files = [WEIGHTS_NAME]
    if layout == "huggingface":
        if not reference:
            raise ConfigError("--format huggingface: the run trained a custom model, not the reference Transformer; "
                              "export --format native and load it with your model's load_state_dict")
        obstacle = family_obstacle(asdict(args))
        if obstacle:
            raise ConfigError(f"--format huggingface: {obstacle}; export --format native")
        state, config = huggingface_model(state, args,
                                          checkpoint.manifest.config["model"].get("max_position_embeddings"))
        config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        _write_json(os.path.join(output, "config.json"), config)
        files.append("config.json")
    elif reference:
        _write_json(os.path.join(output, "model_args.json"), asdict(args))
        files.append("model_args.json")
    if tokenizer is not None:
        files += [os.path.basename(path) for path in tokenizer.save_pretrained(output)]
    weights = os.path.join(output, WEIGHTS_NAME)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, weights,
              metadata={"format": "pt", "step": str(checkpoint.step)})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # safetensors writes it 0600: readable as the JSON beside it is
    return Exported(checkpoint.step, output, tuple(files), sum(tensor.numel() for tensor in state.values()),
                    passed_over)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1)
        handle.write("\n")
