"""How fast each data format gives samples, against how fast the reference shapes take them.

The same documents are written as Parquet, JSONL (plain, gzip, zstd), a HuggingFace dataset
saved with ``save_to_disk``, a Megatron ``.bin``/``.idx`` pair and a flat token file; Parquet,
JSONL and the Megatron pair also go to the S3 API server on loopback (moto). For each, the
driver's index is built (timed), and then one process reads samples in the data plan's
shuffled order as a rank's loader thread does, from a pickled copy (no warm caches):
samples/s, and its ratio to what one rank of the reference shape consumes (one H100 at the
1.23 B shape, 58 k tokens/s: ``--seq-len`` tokens a sample). A ratio above 1 is a loader that
a step never waits for. ``--run`` also trains the reference model on each local format
(Ray, one rank) and prints the data time's share of its steps (``rank_data_s`` over
``rank_step_s`` in ``summary.json``).

    python bench/data.py                 # seq_len 2048, 3000 documents of ~2 KB
    python bench/data.py --run           # and a short run on each format
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from elastic.core.data_plan import epoch_order  # noqa: E402
from elastic.setup.dataset import default_datasets, generate_corpus  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402
from elastic.testing.megatron import write_megatron_pair  # noqa: E402
from elastic.testing.s3 import MotoServer, set_test_credentials  # noqa: E402
from elastic.testing.tokenizer import make_tokenizer  # noqa: E402

REFERENCE_TOKENS_PER_S = 58_000  # one H100, the plain script at the 1.23 B shape (README's figure)


def documents(count: int, size: int) -> list[str]:
    text = generate_corpus(count * size, 5).decode()
    return [text[i * size : (i + 1) * size] for i in range(count)]


def write_formats(directory: Path, texts: list[str], tokenizer: str) -> dict[str, str]:
    from transformers import AutoTokenizer

    rows = [{"text": text} for text in texts]
    pq.write_table(pa.table({"text": texts}), directory / "d.parquet", row_group_size=256)
    jsonl = "".join(json.dumps(row) + "\n" for row in rows).encode()
    (directory / "d.jsonl").write_bytes(jsonl)
    (directory / "d.jsonl.gz").write_bytes(gzip.compress(jsonl))
    import zstandard

    (directory / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    import datasets

    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(directory / "saved"))
    hf = AutoTokenizer.from_pretrained(tokenizer)
    ids = [np.array([*row, hf.eos_token_id], dtype="<u2") for row in hf(texts, add_special_tokens=False)["input_ids"]]
    np.concatenate(ids).tofile(directory / "d.bin")
    write_megatron_pair(directory / "m", ids)
    return {"parquet": "d.parquet", "jsonl": "d.jsonl", "jsonl.gz": "d.jsonl.gz", "jsonl.zst": "d.jsonl.zst",
            "arrow": "saved", "megatron": "m.idx", "tokens": "d.bin"}


def measure(values: dict, samples: int) -> tuple[float, float, int]:
    """(seconds to check and index the data, samples read a second, samples in the data)."""
    began = time.perf_counter()
    config = build_config(values)  # the preflight reads and indexes the data; the run reuses its index
    dataset = default_datasets(config)[0]
    indexed = time.perf_counter() - began
    rank = pickle.loads(pickle.dumps(dataset))  # as a rank gets it
    order = epoch_order(len(rank), config.seed, 0)[:samples]
    began = time.perf_counter()
    for index in order:
        rank[int(index)]
    return indexed, len(order) / (time.perf_counter() - began), len(rank)


def data_share(directory: Path, config_values: dict) -> float:
    from elastic.trainer import ElasticTrainer

    result = ElasticTrainer(build_config(config_values)).fit()
    if not result.ok:
        raise SystemExit(f"the run failed: {result.exit}")
    steps = result.summary["steps"][2:]  # past the first steps' compile and warm-up
    data = sum(max(step["rank_data_s"].values()) for step in steps)
    return data / sum(max(step["rank_step_s"].values()) for step in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=3000)
    parser.add_argument("--document-bytes", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=200, help="samples read per format")
    parser.add_argument("--run", action="store_true", help="also train on each local format and print data_s's share")
    args = parser.parse_args()

    set_test_credentials()
    directory = Path(tempfile.mkdtemp(prefix="bench-data-"))
    texts = documents(args.documents, args.document_bytes)
    tokenizer = str(make_tokenizer(directory / "tokenizer", texts[:500], vocab_size=2000))
    files = write_formats(directory, texts, tokenizer)
    consumed = REFERENCE_TOKENS_PER_S / args.seq_len
    print(f"{args.documents} documents of {args.document_bytes} bytes, seq_len {args.seq_len}; one rank of the "
          f"reference shape takes {consumed:.1f} samples/s")
    print(f"{'format':<22} {'check s':>8} {'samples':>8} {'samples/s':>10} {'x needed':>9}")
    server = MotoServer().start()
    try:
        runs = []
        for where in ("local", "s3"):
            for name, file in files.items():
                if where == "s3" and name not in ("parquet", "jsonl", "megatron"):
                    continue
                path = str(directory / file)
                settings: dict = {}
                if where == "s3":
                    for part in (directory / file).parent.glob(Path(file).stem + ".*"):
                        server.filesystem().put(str(part), f"{server.bucket}/{part.name}")
                    path = server.url(file)
                    settings = {"checkpoint": {"s3_endpoint_url": server.endpoint_url}}
                tokenized = {"tokenizer": tokenizer} if name not in ("megatron", "tokens") else {}
                data = {"path": path, "seq_len": args.seq_len, **tokenized}
                if name == "tokens":
                    data["format"] = "tokens"
                indexed, rate, size = measure({"data": data, "model": {"vocab_size": 2000}, **settings}, args.samples)
                print(f"{name + ' (' + where + ')':<22} {indexed:8.2f} {size:8d} {rate:10.1f} {rate / consumed:9.1f}")
                if where == "local":
                    runs.append((name, data))
        if args.run:
            print(f"\n{'format':<12} {'data_s share of a step':>24}  (reference model, dim 256, one rank, 10 steps)")
            for name, data in runs:
                share = data_share(directory, {
                    "run_name": f"data-{name.replace('.', '-')}", "storage": str(directory / "runs"), "steps": 10,
                    "global_batch": 4, "micro_batch": 2, "data": {**data, "seq_len": 512},
                    "model": {"vocab_size": 2000, "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_hidden": 512}})
                print(f"{name:<12} {share:24.3%}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
