"""OS-level thread names, so that `top -H`, `ps -L`, py-spy and /proc/<pid>/task/*/comm tell nanoserve's threads
apart: otherwise every thread of a Triton stub shows as "triton_python_b" (Python's own thread names stay
inside the interpreter before 3.14)."""
import ctypes
import sys

PR_SET_NAME = 15  # <linux/prctl.h>
MAX_LENGTH = 15  # the kernel's TASK_COMM_LEN, 16, less the terminating NUL


def set_os_thread_name(name: str) -> None:
    """Name the calling thread (first 15 bytes); does nothing where the OS has no such call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:MAX_LENGTH])
    except (OSError, AttributeError):
        pass
