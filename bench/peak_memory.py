"""The resident set's high-water mark of this process, for the benchmark peers.

hwm_reset() resets it (Linux >= 4.0; False where the kernel refuses), so that a peer can
report the peak of its training steps apart from that of building the model; hwm_mib()
reads it from /proc/self/status, in MiB (-1 where it is not reported).
"""


def hwm_reset():
    """Reset the resident set's high-water mark (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_mib():
    """The resident set's high-water mark in MiB, -1 if /proc does not report it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return -1.0
