"""The datasets a config names, translated from its ``data`` section: the generated default
corpus, or each path in its format (``elastic.data.formats``: a token stream as it lies, or
documents tokenized and packed), mixed by weight, and the validation data beside them.

A sample is ``seq_len + 1`` tokens (inputs and shifted targets). The driver owns the order;
a dataset only answers ``len`` and ``[index]``. Every dataset is small to pickle: it holds a
recipe and reads its tokens lazily on the worker that reads them. Documents are indexed here,
on the driver, once.

This module owns the datasets a config names (``default_datasets``) and the check that the
config's data can be read at all (``check_readable``, run by ``elastic.setup.preflight``). It
reads a config and sits above it: the config is imported only as a type, so reading data
never loads pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointing.storage import join_url
from elastic.data.digests import data_identity  # noqa: F401  (the trainer's and the tests' name for it)
from elastic.data.documents import DataError
from elastic.data.formats import FORMATS, Reading, detect
from elastic.data.generated import GeneratedCorpus, generate_corpus  # noqa: F401  (the benchmarks' and the tests')
from elastic.data.kept import KeptFiles
from elastic.data.mixture import Mixture
from elastic.data.packing import PackedDocuments
from elastic.data.ray_dataset import materialize
from elastic.data.splits import SampleRange, held_out_split
from elastic.data.tokenizing import tokenizer_for
from elastic.data.windows import TokenWindows
from elastic.setup.errors import ConfigError, invalid_config

if TYPE_CHECKING:
    from elastic.setup.config import DataSource, TrainConfig

# The held-out corpus made beside the generated default one: another seed, a tenth of the size.
_VALIDATION_SEED_OFFSET = 1_000_003

_DOCUMENTS = [format.name for format in FORMATS.values() if format.documents]


def _listed(names: list[str], last: str) -> str:
    return ", ".join(names[:-1]) + f" {last} " + names[-1]


def source_format(config: TrainConfig, path: str, declared: str | None = None) -> str:
    """The format ``path`` is read as: as declared (a source's own, else ``data.format``), or
    for ``auto`` as ``elastic.data.formats.detect`` finds it."""
    chosen = declared or config.data.format
    if chosen != "auto":
        return chosen
    return detect(path, config.checkpoint.storage_options().for_url(path))


def reading_of(config: TrainConfig, path: str) -> Reading:
    """What the formats open ``path`` with: ``data``'s settings, the run's S3 settings for it."""
    data = config.data
    return Reading(path, data.seq_len, data.token_dtype, data.text_column, data.max_document_bytes,
                   config.checkpoint.storage_options().for_url(path), kept_data(config))


def file_dataset(config: TrainConfig, path: str, declared: str | None = None) -> TokenWindows:
    """The dataset at ``path`` in its format, opened with the run's S3 settings; documents
    (parquet, jsonl, arrow, chat, ...) indexed now, on this process."""
    data = config.data
    chosen = source_format(config, path, declared)
    format = FORMATS[chosen]
    if not format.documents and data.document_masking:  # tokens as they lie, no documents to tokenize or mask
        raise ValueError(f"data.document_masking needs documents ({_listed(_DOCUMENTS, 'or')}), and {path} is "
                         f"{chosen}; unset data.document_masking or give documents")
    if not format.documents and data.tokenizer:
        raise ValueError(f"data.tokenizer applies to {_listed(_DOCUMENTS, 'and')} documents, not to {path} "
                         f"({chosen}); tokenize text files with `elastic prepare --tokenizer`, or unset data.tokenizer")
    read = reading_of(config, path)
    opened = format.open(read)
    if not format.documents:
        return opened
    tokenizer = tokenizer_for(data.tokenizer, data.max_document_bytes, data.chat_template_timeout_s)
    packed = PackedDocuments(opened, tokenizer, data.seq_len, data.document_masking, read.kept)
    packed.build_index()
    return packed


def kept_data(config: TrainConfig) -> KeptFiles | None:
    """Where a named run keeps its data index and its files' digests, for its later legs; an
    unnamed run is never resumed."""
    if not config.run_name:
        return None
    return KeptFiles(join_url(config.storage, config.run_name, "data", "index"),
                     config.checkpoint.storage_options().for_url(config.storage))


def training_dataset(config: TrainConfig) -> TokenWindows | Mixture:
    """``data.path``'s dataset, or ``data.sources`` mixed by weight."""
    sources = config.data.sources
    if not sources:
        return file_dataset(config, config.data.path)
    datasets = [file_dataset(read_as(config, source), source.path, source.format) for source in sources]
    mixture = Mixture(datasets, [source.weight for source in sources], [source.name for source in sources],
                      config.seed, config.global_batch)
    problems = mixture.problems()
    if problems:
        raise ConfigError(invalid_config(problems[:1]))
    return mixture


def read_as(config: TrainConfig, source: DataSource) -> TrainConfig:
    """The config a mixture's source is read with: its own text_column, where it gives one."""
    data = config.data.model_copy(update={"text_column": source.text_column or config.data.text_column})
    return config.model_copy(update={"data": data})


def ray_dataset_source(config: TrainConfig, dataset, directory: str, vocab_size: int | None) -> TokenWindows:
    """A ``ray.data.Dataset`` as a Parquet source of the run: written once under ``directory``
    (``elastic.data.ray_dataset``), then packed as ``data.text_column``, ``data.tokenizer`` say."""
    storage_options = config.checkpoint.storage_options().for_url(directory)
    path = materialize(dataset, directory, storage_options)
    return bounded(file_dataset(config, path, "parquet"), vocab_size, "dataset")


def check_readable(config: TrainConfig) -> None:
    """Raise ValueError naming the field when the training or validation data cannot be read
    as its format, with the run's S3 settings."""
    fields = [(f"sources[{i}].path", source.path, source.format, read_as(config, source))
              for i, source in enumerate(config.data.sources)]
    fields += [(field, getattr(config.data, field), None, config) for field in ("path", "validation_path")]
    for field, path, declared, reading in fields:
        if path is None:
            continue
        try:
            chosen = source_format(config, path, declared)  # once: auto probes the storage
            dataset = file_dataset(reading, path, chosen)
            len(dataset)  # sizes: enough data for one sample
            dataset[0]  # and it reads as the ranks will, by range
            check = FORMATS[chosen].check
            if check:
                check(dataset, reading_of(reading, path))
        except OSError as error:
            # A transport's error (a refused connection) names the host, not what was read.
            where = "" if str(path) in str(error) else f"{path}: "
            raise ValueError(f"data.{field}: {where}{error}; give a readable file, glob or fsspec URL") from None
        except ValueError as error:
            raise ValueError(f"data.{field}: {error}") from None


def bounded(dataset: TokenWindows, vocab_size: int | None, field: str) -> TokenWindows:
    """``dataset`` checked against ``vocab_size`` (None: unchecked), a sample of it now."""
    dataset.vocab_size = vocab_size
    if vocab_size is not None:
        try:
            dataset.check_token_ids()
        except DataError as error:
            raise ConfigError(f"{field}: {error}; point it at data tokenized for model.vocab_size") from None
    return dataset


def default_datasets(config: TrainConfig, vocab_size: int | None = None,
                     ) -> tuple[TokenWindows | SampleRange, TokenWindows | SampleRange | None]:
    """(train, validation) from ``config.data``; validation is None when the config asks for none.

    Validation comes from ``data.validation_path``, or else the training data's last
    ``data.validation_fraction``; the generated default corpus always has one (a held-out
    corpus of its own). With ``vocab_size`` (the reference model's), a sample of windows of
    each file is checked now and every window as a rank reads it.
    """
    data = config.data
    if data.sources:
        train = training_dataset(config)
        for i, source in enumerate(train.sources):
            bounded(source, vocab_size, f"data.sources[{i}].path")
    elif data.path:
        train = bounded(file_dataset(config, data.path), vocab_size, "data.path")
    else:
        train = GeneratedCorpus(data.seq_len, data.corpus_tokens, config.seed)
    if data.validation_path:
        return train, bounded(file_dataset(config, data.validation_path), vocab_size, "data.validation_path")
    if data.validation_fraction:
        try:
            return held_out_split(train, data.validation_fraction)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"data.validation_fraction: the training data cannot be split: {error}; check data.path"
            ) from None
    if not data.path:
        n_bytes = max(data.corpus_tokens // 10, 8 * (data.seq_len + 1))
        return train, GeneratedCorpus(data.seq_len, n_bytes, config.seed + _VALIDATION_SEED_OFFSET)
    return train, None
