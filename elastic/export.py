"""``elastic export``: a run's committed checkpoint as one consolidated safetensors file.

The checkpoint's model shards (FSDP and tensor-parallel pieces, in DCP's files) are read
into whole tensors in one process, with no process group and no code run from storage
(``rank_io.SafeReader``, ``SafeLoadPlanner``). Two layouts:

- ``native``: the model's own parameter names, loadable with ``load_state_dict`` by the model
  the run trained (``workers.model.Transformer`` for the reference model, whose
  ``ModelArgs`` go beside it in ``model_args.json``);
- ``huggingface`` (the reference model only): HuggingFace Llama's (Mixtral's, Qwen3's or
  Qwen3-MoE's) names and ``config.json``, loadable by ``AutoModelForCausalLM.from_pretrained``,
  converted by the table ``model.init_from`` reads with (``checkpointing.huggingface``). A run
  that started from a HuggingFace directory keeps what that directory says about generating:
  its token ids (``TOKEN_ID_FIELDS``), its ``generation_config.json`` and its tokenizer.

Every file is written whole into a directory of its own inside the output, then renamed over
its name: a link there to a file elsewhere is replaced, never written through.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpointing.catalog import CheckpointCatalog, NoUsableCheckpoint
from checkpointing.huggingface import (
    CONFIG_NAME, WEIGHTS_NAME, config_json, family_obstacle, huggingface_state, layout_of,
)
from checkpointing.manifest import CorruptCheckpoint, Manifest
from checkpointing.rank_io import SafeLoadPlanner, SafeReader
from checkpointing.safe_loading import load_metadata
from checkpointing.signing import signing_key_from_environment
from checkpointing.storage import StorageOptions
from elastic.setup.config import TrainConfig
from elastic.setup.errors import ConfigError
from workers.model import ModelArgs

MODEL_PREFIX = "model."  # the checkpoint holds {"model": ..., "optimizer": ...}, flattened
GENERATION_CONFIG_NAME = "generation_config.json"
# config.json's ids of the tokens generation starts with, stops at (eos: one id or several) and
# pads with: without them a model generates past its end.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# A directory holds a HuggingFace tokenizer where it holds one of these.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


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
    return huggingface_state(state, layout_of(args)), config_json(args, args.max_seq_len, max_position_embeddings)


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


def huggingface_source(manifest: Manifest) -> str | None:
    """The HuggingFace directory the run started from (``model.init_from``), or None: a run from
    scratch, or from another run's checkpoint (whose manifest, not a config.json, the run
    recorded as its source)."""
    init_from = manifest.config.get("model", {}).get("init_from")
    return init_from if init_from and CONFIG_NAME in manifest.source else None


def source_json(source: str, name: str) -> dict | None:
    """The JSON object in the source directory's file ``name``; None where there is no such
    file (a config.json always is: the run read its model from it)."""
    path = os.path.join(source, name)
    if name != CONFIG_NAME and not os.path.exists(path):
        return None
    try:
        with open(path) as file:
            value = json.load(file)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.init_from {source}: {name} does not read ({' '.join(str(error).split())}); a "
                          "huggingface export carries the run's source's settings for generating: put the source "
                          "back as the run started from it, or export --format native") from None
    if not isinstance(value, dict):
        raise ConfigError(f"model.init_from {source}: {name} holds a {type(value).__name__}, not a JSON object; "
                          "correct it there, or export --format native")
    return value


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def source_token_ids(source: str) -> dict[str, Any]:
    """The token ids (``TOKEN_ID_FIELDS``) the source's config.json sets: each an id or null,
    eos also a list of ids."""
    config = source_json(source, CONFIG_NAME)
    ids = {name: config[name] for name in TOKEN_ID_FIELDS if name in config}
    for name, value in ids.items():
        several = name == "eos_token_id" and isinstance(value, list) and value != [] and all(map(is_token_id, value))
        if not (value is None or is_token_id(value) or several):
            raise ConfigError(f"model.init_from {source}: {name} is {value!r} in {CONFIG_NAME}; it must be a token "
                              f"id{' or a list of them' if name == 'eos_token_id' else ''}, or null: correct it "
                              "there, or export --format native")
    return ids


def implied_tokenizer(run_config: dict, source: str | None) -> Any:
    """The tokenizer a huggingface export saves where ``--tokenizer`` names none: the one the
    run's data was tokenized with (``data.tokenizer``), else the source directory's; None
    where there is neither."""
    from elastic.prepare import HuggingFaceTokenizer

    data_tokenizer = run_config.get("data", {}).get("tokenizer")
    if data_tokenizer:
        name, named_by = data_tokenizer, "data.tokenizer"
    elif source and any(os.path.exists(os.path.join(source, file)) for file in TOKENIZER_FILES):
        name, named_by = source, "model.init_from's tokenizer"
    else:
        return None
    try:
        return HuggingFaceTokenizer.load(name, named_by=named_by).tokenizer
    except ConfigError as error:
        raise ConfigError(f"{error} (the run's, which a huggingface export saves beside the weights); "
                          "--tokenizer NAME_OR_PATH saves another") from None


def export_checkpoint(run: str, output: str, step: int | None = None,
                      layout: Literal["native", "huggingface"] = "native", dtype: str | None = None,
                      options: StorageOptions | None = None, tokenizer: str | None = None) -> Exported:
    """Write the run's newest verified checkpoint (or ``step``'s, never another) to the local
    directory ``output``; ``Exported.passed_over`` names the later ones that fail verification.
    ``dtype``: a torch dtype's name to convert floating tensors to (default: as stored, float32).
    ``tokenizer``: a HuggingFace tokenizer (a Hub name or a directory) to save beside the
    weights, so the directory loads whole (``huggingface``: by default the run's, see
    ``implied_tokenizer``); checked before anything is written."""
    if importlib.util.find_spec("safetensors") is None:  # said before anything is read
        raise ConfigError("elastic export needs safetensors: pip install 'elastic-trainer[export]'")
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"--output {output}: a file is there; give a directory (new, or one to write into)")
    if tokenizer is not None:
        from elastic.prepare import HuggingFaceTokenizer

        tokenizer = HuggingFaceTokenizer.load(tokenizer).tokenizer
    options = options or StorageOptions()
    catalog = CheckpointCatalog(run, options, every=1, keep=1, signing_key=signing_key_from_environment())
    checkpoint = catalog.find(step)
    passed_over = later_steps_passed_over(catalog, checkpoint.step) if step is None else ()
    args = reference_model_args(checkpoint.manifest.config) if checkpoint.manifest.config.get("model") else None
    documents: dict[str, dict] = {}
    token_ids: dict[str, Any] = {}
    if layout == "huggingface":
        source = huggingface_source(checkpoint.manifest)
        if source is not None:
            token_ids = source_token_ids(source)
            generation = source_json(source, GENERATION_CONFIG_NAME)
            if generation is not None:
                documents[GENERATION_CONFIG_NAME] = generation
        if tokenizer is None:
            tokenizer = implied_tokenizer(checkpoint.manifest.config, source)
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
    reference = args is not None and is_reference_model(state, args)
    if layout == "huggingface":
        if not reference:
            raise ConfigError("--format huggingface: the run trained a custom model, not the reference Transformer; "
                              "export --format native and load it with your model's load_state_dict")
        obstacle = family_obstacle(args)
        if obstacle:
            raise ConfigError(f"--format huggingface: {obstacle}; export --format native")
        state, config = huggingface_model(state, args,
                                          checkpoint.manifest.config["model"].get("max_position_embeddings"))
        config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        documents[CONFIG_NAME] = config | token_ids
    elif reference:
        documents["model_args.json"] = asdict(args)
    files = write_directory(output, state, checkpoint.step, documents, tokenizer)
    return Exported(checkpoint.step, output, files, sum(tensor.numel() for tensor in state.values()), passed_over)


def write_directory(output: str, state: dict[str, torch.Tensor], step: int, documents: dict[str, dict],
                    tokenizer: Any) -> tuple[str, ...]:
    """Write the weights, the JSON ``documents`` by file name and the tokenizer (where one is
    given) into ``output``, each file whole in a directory of its own there first, then renamed
    over its name: a link of that name is replaced, not followed. Returns the names written."""
    from safetensors.torch import save_file

    os.makedirs(output, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=output)
    try:
        weights = os.path.join(staging, WEIGHTS_NAME)
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, weights,
                  metadata={"format": "pt", "step": str(step)})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(weights, 0o666 & ~umask)  # safetensors writes it 0600: readable as the JSON beside it is
        for name, value in documents.items():
            _write_json(os.path.join(staging, name), value)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        names = [WEIGHTS_NAME, *sorted(set(os.listdir(staging)) - {WEIGHTS_NAME})]
        for name in names:
            try:
                os.replace(os.path.join(staging, name), os.path.join(output, name))
            except OSError as error:
                raise ConfigError(f"--output {output}: {name} there cannot be replaced ({error.strerror}); move it "
                                  "away, or give another directory") from None
        return tuple(names)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_json(path: str, value: dict) -> None:
    with open(path, "x") as handle:
        json.dump(value, handle, indent=1)
        handle.write("\n")
