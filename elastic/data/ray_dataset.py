"""A ``ray.data.Dataset`` given to the Python API, made exactly-once: written once as Parquet
into the run's storage, then read as any Parquet source (indexed on the driver, read by row
group on the ranks).

A Ray dataset is a pipeline that may give its rows in another order, or other rows, each
time it runs; a data cursor over it would mean nothing after a kill or a resume. Written
once, its rows have places, and every later leg of the run reads the same files: a
``_COMPLETE`` marker says the writing finished, and a leg that finds it does not write again
(so a changed Ray dataset is not seen by a resumed run: start another run to train on it).
Cost: one pass over the dataset and its size in storage, before the first step.
"""

from __future__ import annotations

import logging
import time

from fsspec.core import url_to_fs

from elastic.data.documents import DataError

log = logging.getLogger("elastic.data.ray_dataset")

COMPLETE = "_COMPLETE"


def is_ray_dataset(dataset) -> bool:
    """Without importing Ray: a run given no Ray dataset never pays for the import."""
    return type(dataset).__module__.startswith("ray.data") and hasattr(dataset, "write_parquet")


def materialize(dataset, directory: str, storage_options: dict) -> str:
    """The glob of the Parquet files ``dataset`` was written to under ``directory``: written
    now, or found whole from an earlier leg of the run."""
    fs, path = url_to_fs(directory, **storage_options)
    if not fs.exists(f"{path}/{COMPLETE}"):
        if fs.exists(path):  # an earlier leg died while writing: its files are not the data
            fs.rm(path, recursive=True)
        import pyarrow.fs

        began = time.perf_counter()
        dataset.write_parquet(path, filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)))
        if not fs.glob(f"{path}/*.parquet"):  # Ray writes no file for no rows (and removes the directory)
            raise DataError(f"{directory}: the Ray dataset given has no rows, so nothing was written to train on; "
                            "give a dataset with rows")
        fs.pipe(f"{path}/{COMPLETE}", b"")
        log.info("the Ray dataset was written to %s in %.1f s", directory, time.perf_counter() - began)
    return f"{directory.rstrip('/')}/*.parquet"
