"""TorchTitan's own trainer on one device, for a side-by-side throughput figure.

Runs ``torchtitan.train`` (the PyPI package ``torchtitan`` 0.2.2: 0.3.0 needs a newer torch
than the GPU image's 2.11, it fails at import on ``torch.distributed.fsdp.DataParallelMeshDims``)
as torchtitan documents it, ``torchrun --nproc_per_node 1 -m torchtitan.train
--job.config_file X.toml``, on the "1.23 B shape" of ``bench/gpu.py --preset 1b``: its llama3
model, dim 2048, 24 layers, 16 heads (no GQA), FFN hidden 5632, a byte vocabulary of 256
(untied), seq_len 2048, a global batch of 16 sequences as micro-batches of 4 (gradient
accumulation 4), AdamW, 30 steps. The rest is torchtitan's default on one GPU: no FSDP there
(one rank), bf16 autocast over fp32 weights (``training.mixed_precision_param``), SDPA causal
attention, torch.compile of each block and of the loss, fused AdamW (lr 8e-4, wd 0.1), clipping
at 1.0; activation checkpointing off, no checkpoints, no validation.

The TOML is written into a temp dir with a copy of this file, the module ``tt_bench_config``,
which the trainer imports through ``[experimental] custom_import``: it adds the model flavor
(``bench_1b`` / ``bench_tiny``) to torchtitan's llama3 registry from ``$TT_BENCH_SPEC`` and
wraps the trainer's ``MetricsProcessor.log`` to read ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` at each step, before torchtitan resets the peaks: the run's peak (step 1
with init and compile included) and the steady one (the steps after the warmup). The data is
torchtitan's HuggingFace text loader (its ``c4_test`` entry pointed at a local JSON-lines file
of random text) and its HuggingFace tokenizer (a byte-level ``tokenizer.json`` of 256 tokens,
id = byte, made with ``tokenizers``); nothing is fetched. The trainer logs every step
(``log_freq = 1``); the figure is the median of its own per-step ``tps`` after the first 5.

Prints one line on stdout, ``TORCHTITAN_RESULT {json}``; the trainer's log goes to stderr.
Exits non-zero with a one-line reason on failure or after ``--timeout`` seconds.

    source .gpu/env.sh && python3 bench/torchtitan_job.py           # GPU, the 1.23 B shape
    python bench/torchtitan_job.py --device cpu --quick               # CPU rehearsal, tiny shape

torchtitan's trainer wants an accelerator (it takes CUDA when none is found), so ``--device
cpu`` starts it through a shim that gives it ``cpu`` as its device (gloo, no memory stats);
only the GPU run is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULT_PREFIX = "TORCHTITAN_RESULT "
SPEC_ENV = "TT_BENCH_SPEC"
CONFIG_MODULE = "tt_bench_config"
WARMUP = 5
SHAPES = {  # bench/gpu.py's presets "1b" and "tiny"
    "1b": {"dim": 2048, "n_layers": 24, "n_heads": 16, "ffn_hidden": 5632, "vocab": 256, "seq_len": 2048,
           "global_batch": 16, "micro_batch": 4, "steps": 30},
    "tiny": {"dim": 128, "n_layers": 2, "n_heads": 4, "ffn_hidden": 384, "vocab": 256, "seq_len": 128,
             "global_batch": 8, "micro_batch": 2, "steps": 10},
}
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+).*?memory:\s*(-?[\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


# ------------------------------------------------ inside the trainer process (custom_import)

def register_flavor() -> None:
    """Adds this run's flavor to torchtitan's llama3 registry; on CUDA, records memory peaks."""
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    spec = json.loads(os.environ[SPEC_ENV])
    s = spec["shape"]
    multiple_of = 256 if s["ffn_hidden"] % 256 == 0 else 128
    hidden = int(2 * 4 * s["dim"] / 3)  # torchtitan's FeedForward sizing
    if multiple_of * -(-hidden // multiple_of) != s["ffn_hidden"]:
        raise ValueError(f"FFN hidden {s['ffn_hidden']} is not what torchtitan sizes for dim {s['dim']}")
    masks = {"sdpa": "causal", "flex": "block_causal", "varlen": "block_causal"}
    llama3_args[spec["flavor"]] = TransformerModelArgs(
        dim=s["dim"], n_layers=s["n_layers"], n_heads=s["n_heads"], vocab_size=s["vocab"], multiple_of=multiple_of,
        rope_theta=10000, attn_type=spec["attn"], attn_mask_type=masks[spec["attn"]],
    )
    if spec["device"] == "cuda":
        import torch
        from torchtitan.components.metrics import MetricsProcessor

        log = MetricsProcessor.log

        def log_and_record(self, step, *args, **kwargs):
            with open(spec["memory_file"], "a") as f:
                f.write(json.dumps([step, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]) + "\n")
            return log(self, step, *args, **kwargs)

        MetricsProcessor.log = log_and_record


def cpu_bootstrap(argv: list[str]) -> None:
    """CPU rehearsal only: make torchtitan take ``cpu`` as its accelerator, then run
    ``torchtitan.train`` as ``python -m`` would."""
    import runpy
    import types

    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = torch.cpu
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=total)
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.current_device = lambda: 0  # torchtitan passes it to barrier(device_ids=...)
    sys.argv = ["torchtitan.train", *argv]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


# ----------------------------------------------------------------------------- the driver

def fail(reason: str) -> None:
    print(f"torchtitan_job: FAILED: {reason}", file=sys.stderr, flush=True)
    sys.exit(1)


def byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` without merges: 256 tokens, id = byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = {}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode, the ByteLevel pre-tokenizer's alphabet
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], n = chr(256 + n), n + 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    if tok.encode("A b~\n").ids != list(b"A b~\n"):
        fail("the byte tokenizer does not map id = byte")


def text_dataset(folder: Path, shape: dict) -> None:
    """Random lowercase text in documents of 4 sequences, enough for the run (the loader
    re-loops if short)."""
    rng = random.Random(0)
    doc_len = 4 * shape["seq_len"]
    docs = shape["steps"] * shape["global_batch"] * shape["seq_len"] // doc_len + 8
    folder.mkdir(parents=True)
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz  ", k=doc_len))}) + "\n")


def write_toml(path: Path, sections: dict) -> None:
    """Flat TOML: sections of strings, numbers, booleans and lists (JSON spells them alike)."""
    with open(path, "w") as f:
        for name, values in sections.items():
            f.write(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()) + "\n")


def run_trainer(cmd: list[str], env: dict, timeout: float, log_path: Path) -> int | None:
    """Runs ``cmd`` in its own session, teeing its output to stderr and ``log_path``; kills the
    whole session after ``timeout`` seconds (and returns None)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                sys.stderr.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        reader.join(timeout=10)
    return rc


def failure_reason(lines: list[str], rc) -> str:
    for line in reversed(lines):
        text = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
        if re.match(r"^(\w+\.)*[A-Z]\w*(Error|Exception|Failed|Interrupt)\b", text) and "ChildFailedError" not in text:
            return f"trainer exited with {rc}: {text[:300]}"
    return f"trainer exited with {rc}; last line: {(lines[-1].strip() if lines else '(no output)')[:300]}"


def version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version as v

    try:
        return v(dist)
    except PackageNotFoundError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="the tiny shape (dim 128, 2 layers, seq 128, 10 steps)")
    p.add_argument("--steps", type=int, help="override the shape's step count (30; --quick 10)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile off")
    p.add_argument("--attn", choices=["sdpa", "flex", "varlen"], default="sdpa",
                   help="torchtitan's attention (default: its llama3 default, sdpa causal; flex and varlen "
                        "are block-causal over documents, and need the GPU)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before the trainer is killed")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (config, assets, data, log)")
    args = p.parse_args()

    preset = "tiny" if args.quick else "1b"
    shape = dict(SHAPES[preset])
    if args.steps:
        shape["steps"] = args.steps
    if shape["steps"] <= WARMUP:
        fail(f"--steps must be more than the warmup of {WARMUP}")
    if version("torchtitan") is None:
        fail("torchtitan is not installed (pip install torchtitan==0.2.2, or carry its wheel)")

    work = Path(tempfile.mkdtemp(prefix="tt_bench_"))
    try:
        shutil.copyfile(__file__, work / f"{CONFIG_MODULE}.py")
        byte_tokenizer(work / "tokenizer")
        text_dataset(work / "data", shape)
        spec = {"flavor": f"bench_{preset}", "shape": shape, "device": args.device, "attn": args.attn,
                "memory_file": str(work / "memory.jsonl")}
        write_toml(work / "job.toml", {
            "job": {"dump_folder": str(work / "outputs"), "description": f"torchtitan_job {preset}"},
            "metrics": {"log_freq": 1, "disable_color_printing": True, "enable_tensorboard": False},
            "model": {"name": "llama3", "flavor": spec["flavor"], "hf_assets_path": str(work / "tokenizer")},
            "optimizer": {"name": "AdamW", "lr": 8e-4, "eps": 1e-8, "weight_decay": 0.1, "implementation": "fused"},
            "lr_scheduler": {"warmup_steps": 2, "decay_ratio": 0.8, "decay_type": "linear", "min_lr_factor": 0.0},
            "training": {"local_batch_size": shape["micro_batch"], "global_batch_size": shape["global_batch"],
                         "seq_len": shape["seq_len"], "steps": shape["steps"], "max_norm": 1.0,
                         "dataset": "c4_test", "dataset_path": str(work / "data"),
                         "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"},
            "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1},
            "checkpoint": {"enable": False},
            "activation_checkpoint": {"mode": "none"},
            "compile": {"enable": not args.no_compile, "components": ["model", "loss"]},
            "validation": {"enable": False},
            "experimental": {"custom_import": CONFIG_MODULE},
            "debug": {"seed": 0},
        })
        env = dict(os.environ)
        env.update({
            SPEC_ENV: json.dumps(spec), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(work), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf"),
        })
        entry = ["-m", "torchtitan.train"] if args.device == "cuda" else ["-m", CONFIG_MODULE, "--cpu-bootstrap"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "1",
               *entry, "--job.config_file", str(work / "job.toml")]
        print("torchtitan_job: " + " ".join(cmd), file=sys.stderr, flush=True)
        start = time.monotonic()
        rc = run_trainer(cmd, env, args.timeout, work / "train.log")
        wall = time.monotonic() - start
        lines = (work / "train.log").read_text(errors="replace").splitlines()
        if rc is None:
            fail(f"timed out after {args.timeout:.0f} s (last line: {lines[-1].strip()[:200] if lines else '-'})")
        if rc != 0:
            fail(failure_reason(lines, rc))

        steps = {}
        for line in lines:
            if m := STEP_LINE.search(line):
                steps[int(m.group(1))] = {"loss": float(m.group(2)), "reserved_gib": float(m.group(3)),
                                          "tps": int(m.group(4).replace(",", "")), "mfu": float(m.group(5))}
        measured = [steps[i] for i in sorted(steps) if i > WARMUP]
        if len(steps) != shape["steps"] or not measured:
            fail(f"parsed {len(steps)} step lines from the trainer's log, expected {shape['steps']}")
        device_name = next((m.group(1) for line in lines
                            for m in [re.search(r"capacity: (.+?) with [\d.]+GiB memory", line)] if m), None)
        memory_file = Path(spec["memory_file"])
        mem = [json.loads(x) for x in memory_file.read_text().splitlines()] if memory_file.exists() else []
        steady = [m for m in mem if m[0] > WARMUP]
        gib = lambda rows, i: round(max(r[i] for r in rows) / 2**30, 3) if rows else None  # noqa: E731
        result = {
            "system": "torchtitan",
            "torchtitan_version": version("torchtitan"),
            "torch_version": version("torch"),
            "device": device_name or args.device,
            "preset": preset,
            "shape": shape,
            "settings": {"attn": args.attn, "compile": not args.no_compile, "activation_checkpointing": None,
                         "precision": "bf16 autocast, fp32 weights (torchtitan's one-device default, no FSDP)",
                         "optimizer": "AdamW fused"},
            "warmup_steps": WARMUP,
            "tokens_per_step": shape["global_batch"] * shape["seq_len"],
            "tokens_per_s": statistics.median(s["tps"] for s in measured),
            "tokens_per_s_by_step": [steps[i]["tps"] for i in sorted(steps)],
            "mfu_pct_torchtitan": round(statistics.median(s["mfu"] for s in measured), 2),
            "peak_mem_allocated_gib": gib(mem, 1),
            "peak_mem_reserved_gib": gib(mem, 2),
            "steady_mem_allocated_gib": gib(steady, 1),
            "steady_mem_reserved_gib": gib(steady, 2),
            "loss_first_last": [steps[min(steps)]["loss"], steps[max(steps)]["loss"]],
            "wall_s": round(wall, 1),
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    finally:
        if args.keep:
            print(f"torchtitan_job: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == CONFIG_MODULE:  # imported by the trainer: [experimental] custom_import
    register_flavor()
elif __name__ == "__main__":
    if sys.argv[1:2] == ["--cpu-bootstrap"]:
        cpu_bootstrap(sys.argv[2:])
    else:
        main()
