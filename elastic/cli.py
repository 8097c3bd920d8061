"""The ``elastic`` command: ``train``, ``prepare``, ``report`` and ``export``. For ``train``, flags
override the config file field by field, and ``--set`` any field."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import tomllib
import traceback

from checkpointing.lease import LeaseRefused
from elastic.setup.errors import ConfigError
from elastic.core.events import EventKind, RedactingFormatter, redact_credentials
from elastic.stop_signals import SignalsBeforeTheRun
from elastic.setup.presets import PRESETS


def parse_groups(text: str) -> dict[str, int]:
    low, sep, high = text.partition(":")
    try:
        low_n = int(low)
        high_n = int(high) if sep else low_n
    except ValueError:
        raise argparse.ArgumentTypeError(f"--groups {text!r}: use N or MIN:MAX, e.g. 2 or 1:4") from None
    return {"scaling.min_groups": low_n, "scaling.max_groups": high_n}


def parse_setting(text: str) -> tuple[str, object]:
    """``section.field=value``: the value read as a TOML value (numbers, booleans, strings in
    quotes, arrays), else taken as a string (paths, URLs, names)."""
    field, sep, value = text.partition("=")
    if not sep or not field.strip():
        raise argparse.ArgumentTypeError(f"--set {text!r}: use SECTION.FIELD=VALUE, e.g. data.seq_len=256")
    try:
        parsed = tomllib.loads(f"value = {value}")["value"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return field.strip(), parsed


# flag -> config field; None values are left to the file or the defaults
TRAIN_FLAGS = {
    "run_name": "run_name",
    "storage": "storage",
    "steps": "steps",
    "shard": "scaling.shard",
    "tp": "scaling.tp",
    "pp": "scaling.pp",
    "pp_schedule": "scaling.pp_schedule",
    "spares": "scaling.spares",
    "global_batch": "global_batch",
    "micro_batch": "micro_batch",
    "seed": "seed",
    "metrics_port": "metrics.port",
    "metrics_host": "metrics.host",
    "checkpoint_every": "checkpoint.every",
    "keep": "checkpoint.keep",
    "inject": "fault_tolerance.inject",
    "data": "data.path",
    "device": "scaling.device",
    "precision": "compute.precision",
    "compile": "compute.compile",
    "activation_checkpointing": "compute.activation_checkpointing",
    "sequence_parallel": "scaling.sequence_parallel",
    "start_fresh": "checkpoint.start_fresh",
    "accept_changed_data": "checkpoint.accept_changed_data",
    "preset": "model.preset",
    "init_from": "model.init_from",
    "lr": "optimizer.lr",
    "lr_schedule": "optimizer.schedule",
    "warmup_steps": "optimizer.warmup_steps",
    "clip_grad_norm": "optimizer.clip_grad_norm",
    "eval_every": "eval.every",
}


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: "--step 5" must not silently mean "--steps 5".
    parser = argparse.ArgumentParser(prog="elastic", description="Fault-tolerant, elastic FSDP2 + TP training on Ray",
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model (the embedded default needs no arguments)",
                                allow_abbrev=False)
    train.add_argument("--config", help="TOML or YAML config file")
    train.add_argument("--preset", help=f"model shape: {', '.join(PRESETS)}; model fields the config gives override it "
                                        "(GPU memory per rank: docs/presets.md)")
    train.add_argument("--init-from", metavar="SOURCE", help="start from pretrained weights: a HuggingFace Llama or "
                       "Mixtral directory (config.json + safetensors) or another run (RUN or RUN@STEP); it gives the "
                       "model fields")
    train.add_argument("--run-name", help="run name; the same name and storage resume a run")
    train.add_argument("--storage", help="where runs are kept: a local directory or an fsspec URL (s3://bucket/prefix)")
    train.add_argument("--steps", type=int)
    train.add_argument("--groups", type=parse_groups, help="replica groups: N or MIN:MAX")
    train.add_argument("--shard", type=int, help="FSDP2 ranks per group")
    train.add_argument("--tp", type=int, help="tensor-parallel ranks per group")
    train.add_argument("--pp", type=int, help="pipeline stages per group (ranks along the pipeline)")
    train.add_argument("--pp-schedule", help="1F1B (default), GPipe, Interleaved1F1B or InterleavedZeroBubble")
    train.add_argument("--spares", type=int, help="warm spare ranks started ahead, to replace lost ones at once")
    train.add_argument("--global-batch", type=int, help="samples per step, across all groups")
    train.add_argument("--micro-batch", type=int, help="samples per forward/backward on one rank")
    train.add_argument("--seed", type=int)
    train.add_argument("--data", help="training data: text, token ids (.bin: see elastic prepare), Parquet, JSONL, "
                                      "a save_to_disk directory or a Megatron pair (data.format, data.tokenizer); "
                                      "a path, glob or fsspec URL (default: a generated corpus)")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"],
                       help="auto: GPUs when the cluster has them; cuda: one GPU per rank unless gpus_per_rank says otherwise")
    train.add_argument("--precision", choices=["auto", "fp32", "bf16"], help="auto: bf16 on CUDA, fp32 on CPU")
    train.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="torch.compile each transformer block")
    train.add_argument("--activation-checkpointing", choices=["none", "full", "selective"],
                       help="full: recompute each block in backward; selective: as compute.selective_checkpointing says "
                            "(op: half the matmuls and the element-wise ops; N: every Nth block)")
    train.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                       help="shard the residual stream and norms on the sequence between TP regions "
                            "(default: on when tp > 1 divides seq_len and the model has no dropout)")
    train.add_argument("--lr", type=float, help="peak learning rate")
    train.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"],
                       help="after the warmup: keep the peak, or decay to optimizer.min_lr_ratio x lr")
    train.add_argument("--warmup-steps", type=int, help="linear warmup to the peak learning rate")
    train.add_argument("--clip-grad-norm", type=float, help="clip gradients to this global norm")
    train.add_argument("--eval-every", type=int, help="held-out loss every N steps and at the end (0: never)")
    train.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: off)")
    train.add_argument("--metrics-host", help="address to serve metrics on (default 127.0.0.1)")
    train.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (0: only at the end)")
    train.add_argument("--keep", type=int, help="committed checkpoints to keep")
    train.add_argument("--start-fresh", action="store_true", default=None,
                       help="when every checkpoint of the run fails verification, move them aside and train from step 0")
    train.add_argument("--break-lease", action="store_true",
                       help="first end the run's lease when its record is unreadable; only when no other driver of "
                            "the run is running (needs --run-name)")
    train.add_argument("--accept-changed-data", action="store_true", default=None,
                       help="resume although the data changed since the checkpoint (its files, sources, weights, "
                            "tokenizer or columns): the data starts over from its first epoch")
    train.add_argument("--inject", help='faults, e.g. "kill:rank=3,step=7;hang:rank=2,step=22"')
    train.add_argument("--set", action="append", default=[], type=parse_setting, metavar="SECTION.FIELD=VALUE",
                       help="any config field, e.g. --set data.seq_len=256 --set optimizer.beta2=0.99 (repeatable; "
                            "VALUE as in TOML, else a string)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    report = commands.add_parser("report", help="timeline PNG and goodput breakdown of a run", allow_abbrev=False)
    report.add_argument("run", help="a run directory or storage URL")
    report.add_argument("-o", "--output", help="PNG path")
    prepare = commands.add_parser("prepare", help="write text as a byte-level token file to train on (data.format = tokens)",
                                  allow_abbrev=False)
    prepare.add_argument("inputs", nargs="+", metavar="TEXT", help="text files: paths, globs or fsspec URLs, in order")
    prepare.add_argument("--output", required=True, help="the token file: a path or fsspec URL, e.g. train.bin")
    prepare.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto",
                         help="token width (auto: uint16 when every token fits)")
    prepare.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                         help="a HuggingFace tokenizer: a Hub name or a local directory (the tokenizer extra); "
                              "default: bytes")
    prepare.add_argument("--eos", type=int,
                         help="token id appended after each input file (default: the tokenizer's end-of-text id)")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    export = commands.add_parser("export", allow_abbrev=False,
                                 help="a run's checkpoint as one safetensors file, loadable on one device")
    export.add_argument("run", help="the run's directory or storage URL (STORAGE/RUN_NAME)")
    export.add_argument("--output", required=True, help="a local directory to write into")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the newest that verifies)")
    export.add_argument("--format", choices=["native", "huggingface"], default="native",
                        help="native: the model's own names (Transformer.load_state_dict); huggingface: Llama's "
                             "names and config.json (LlamaForCausalLM.from_pretrained; the reference model only)")
    export.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="convert floating tensors (default: as stored, float32)")
    export.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                        help="a HuggingFace tokenizer to save beside the weights (the one `elastic prepare "
                             "--tokenizer` tokenized the data with), so the directory loads whole; --format "
                             "huggingface saves the run's data.tokenizer without it, else its --init-from's")
    return parser


def train_overrides(args: argparse.Namespace) -> dict:
    overrides = {field: getattr(args, flag) for flag, field in TRAIN_FLAGS.items() if getattr(args, flag) is not None}
    if args.groups:
        overrides.update(args.groups)
    overrides.update(args.set)  # last: --set says exactly which field it means
    return overrides


def run_train(args: argparse.Namespace) -> int:
    early = SignalsBeforeTheRun()
    # Imported after the signals are caught: reading the config brings pydantic.
    from checkpointing.lease import break_lease
    from checkpointing.storage import join_url
    from elastic.setup.preflight import load_config

    config = load_config(args.config, train_overrides(args))
    if args.break_lease:
        if not config.run_name:
            raise ConfigError("--break-lease: name the run whose lease to end with --run-name (or run_name)")
        generation = break_lease(join_url(config.storage, config.run_name), config.checkpoint.storage_options())
        print(f"run {config.run_name}: lease ended (generation {generation} written, released)")
    from elastic.trainer import ElasticTrainer  # after the config: a refusal need not wait for torch and Ray

    trainer = ElasticTrainer(config, progress=not args.quiet)
    result = trainer.fit(signalled_before=early.received)
    # The run has its ending, written: a late signal must not end the process in a traceback
    # (Ray's exit hook still runs), nor change the exit code. Lingering takes Ctrl-C again.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    summary = result.record
    total = summary.run_total
    print(redact_credentials(
        f"run {result.run}: {summary.exit}; {summary.steps_committed} steps committed, "
        f"{summary.steps_discarded} discarded; final loss "
        f"{'none' if summary.final_loss is None else format(summary.final_loss, '.4f')}; "
        f"goodput {summary.goodput:.1%}"
        + (f" (the whole run, {total.legs} legs: {total.goodput:.1%})" if total and total.legs > 1 else "")
        + f"; last checkpoint {summary.last_checkpoint}; summary at {result.summary_path}"
    ))
    linger_for_scrapes(summary.events, config.metrics.linger_s)
    return result.ended.code


def linger_for_scrapes(events: list[dict], seconds: float, sleep=time.sleep) -> None:
    """Keep the process, and with it the metrics endpoint, up ``seconds`` after the run."""
    serving = [event["address"] for event in events if event["kind"] == EventKind.METRICS_SERVING]
    if not serving or seconds <= 0:
        return
    print(f"metrics stay up at http://{serving[-1]}/metrics for {seconds:.0f} s (metrics.linger_s); Ctrl-C ends them",
          flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sleep(seconds)
    except KeyboardInterrupt:
        pass


def run_prepare(args: argparse.Namespace) -> int:
    from elastic.prepare import BYTE_VOCABULARY, HuggingFaceTokenizer, prepare_tokens
    from elastic.setup.config import padded_vocab_size

    tokenizer = HuggingFaceTokenizer.load(args.tokenizer) if args.tokenizer else None
    eos = args.eos if args.eos is not None or tokenizer is None else tokenizer.eos
    result = prepare_tokens(args.inputs, args.output, tokenizer=tokenizer, dtype=args.dtype, eos=eos,
                            progress=not args.quiet)
    vocabulary = BYTE_VOCABULARY if tokenizer is None else tokenizer.vocab_size
    needed = max(vocabulary, (result.max_token or 0) + 1)
    vocab_size = padded_vocab_size(needed)
    print(redact_credentials(
        f"wrote {result.tokens} {result.dtype} tokens to {result.output}; to train on it, in the config file:\n"
        f'[data]\npath = "{result.output}"\nformat = "tokens"\ntoken_dtype = "{result.dtype}"\n'
        f"[model]\nvocab_size = {vocab_size}  # at least {needed}: every token id must be below it"
    ))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from checkpointing.catalog import NoUsableCheckpoint
    from elastic.export import export_checkpoint

    try:
        exported = export_checkpoint(args.run, args.output, step=args.step, layout=args.format, dtype=args.dtype,
                                     tokenizer=args.tokenizer)
    except NoUsableCheckpoint as error:
        raise ConfigError(f"{args.run}: {error}") from None
    print(f"exported step {exported.step} ({exported.parameters:,} values) to {exported.directory}: "
          f"{', '.join(exported.files)}"
          + "".join(f"; step {later.step} was not: {later.reason}" for later in exported.passed_over))
    return 0


# The URLs and names the commands take besides the config's fields (which check their own).
URL_ARGUMENTS = {"run": "RUN", "inputs": "TEXT", "output": "--output", "tokenizer": "--tokenizer"}


def refuse_credentials_in(args: argparse.Namespace) -> None:
    """ConfigError, naming the argument, for a URL argument with credentials in it."""
    from checkpointing.storage import refuse_credentials

    for name, flag in URL_ARGUMENTS.items():
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            try:
                refuse_credentials(value or "")
            except ValueError as error:
                raise ConfigError(f"{flag}: {error}") from None


def fail(error: Exception, exit_status: int) -> int:
    """The error on stderr, redacted: errors quote the user's input, URLs and their secrets included."""
    print(f"elastic: {redact_credentials(str(error))}", file=sys.stderr)
    return exit_status


class ReaderMayLeave:
    """stdout or stderr whose reader may go: a pipe into ``tee`` that the same Ctrl-C stopped,
    a closed terminal. From its first broken write the stream's file goes to /dev/null, so that
    nothing printed (a log line, the progress bar, the last summary line) turns a preemption or
    a completed run into a failure; the run's own log and summary still hold everything."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (BrokenPipeError, ConnectionResetError, ValueError):  # ValueError: the stream was closed
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (BrokenPipeError, ConnectionResetError, ValueError):
            self._to_devnull()

    def _to_devnull(self) -> None:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def print_redacted_traceback(kind: type[BaseException], error: BaseException, trace) -> None:
    """An error no command expected, on stderr as Python prints it, redacted as every other
    line the command prints: its message and its frames may quote a URL and its secrets."""
    sys.stderr.write(redact_credentials("".join(traceback.format_exception(kind, error, trace))))


def configure_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("elastic.events").setLevel(logging.WARNING)
    # torchao, imported with transformers' models, warns of each GPU kernel library it cannot
    # load on a machine without that GPU, and torch of the Enums torchao registers: neither is
    # the user's to act on.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    sys.stdout, sys.stderr = ReaderMayLeave(sys.stdout), ReaderMayLeave(sys.stderr)
    sys.excepthook = print_redacted_traceback
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        refuse_credentials_in(args)
        if args.command == "train":
            return run_train(args)
        if args.command == "prepare":
            return run_prepare(args)
        if args.command == "export":
            return run_export(args)
        from elastic.outputs.report import main as report_main

        return report_main([args.run] + (["--output", args.output] if args.output else []))
    except ConfigError as error:
        return fail(error, 2)
    except LeaseRefused as error:
        return fail(error, 1)
