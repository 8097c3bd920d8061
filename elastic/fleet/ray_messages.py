"""Ray's own messages on the driver's console. A rank that dies is the run's to handle, and its
events say so on one line ("rank 1 of group 0 replaced (death)"); Ray's explanation of the
same death is a paragraph guessing at the OOM killer. Those explanations go to a log file in
Ray's session log directory instead, kept beside Ray's own logs; everything else Ray prints
is left as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

LOG_NAME = "elastic-ray-messages.log"
# How Ray 2.x begins the message for a worker process that died under a task or actor call.
_WORKER_DEATH = "A worker died or was killed while executing a task"


def worker_deaths_to_log_file() -> Callable[[], None]:
    """Route Ray's worker-death messages to ``LOG_NAME`` in Ray's session log directory, from
    now until the returned call; a Ray whose internals differ is left to print them."""
    try:
        import ray._private.worker as ray_worker

        printed = ray_worker.print_to_stdstream
        directory = ray_worker._global_node.get_logs_dir_path()
    except (ImportError, AttributeError):
        return lambda: None
    try:
        file = logging.FileHandler(os.path.join(directory, LOG_NAME))
    except OSError as error:  # Ray's own log directory unwritable: its messages stay as they are
        log.warning("Ray's worker-death messages stay on the console: %s", error)
        return lambda: None
    messages = logging.getLogger("elastic.ray_messages")
    messages.propagate = False  # not on the console: that is the point
    file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    messages.addHandler(file)
    log.debug("Ray's worker-death messages go to %s", file.baseFilename)

    def print_or_log(data: dict, ignore_prefix: bool) -> None:
        lines = data.get("lines") or []
        if data.get("pid") == "raylet" and any(line.startswith(_WORKER_DEATH) for line in lines):
            for line in lines:
                messages.warning("%s", line)
            return
        printed(data, ignore_prefix)

    ray_worker.print_to_stdstream = print_or_log

    def restore() -> None:
        ray_worker.print_to_stdstream = printed
        messages.removeHandler(file)
        file.close()

    return restore
