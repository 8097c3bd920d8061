"""The process's resident memory, read from /proc/self/status."""


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> str:
    """Reset the peak (VmHWM) so it measures what follows alone; returns the field to read
    (VmRSS where the kernel does not allow the reset)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return "VmHWM"
    except OSError:
        return "VmRSS"
