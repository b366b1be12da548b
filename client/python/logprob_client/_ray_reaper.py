"""Removes a Ray actor's folders once the actor and its process are gone.

Run by ``logprob_client.ray``'s actors as a script (standard library only)::

    python -I _ray_reaper.py PID FD FOLDER...

``FD`` is the read end of a pipe whose write end only the actor holds: it
reads end-of-file when the actor's process ends, however it ends (``stop``,
``ray.kill``, SIGKILL, its driver's death). The reaper then waits until the
process ``PID`` (the actor's logprob- process, which dies with its actor) has
exited, removes every ``FOLDER`` and exits. It detaches first (a new session,
and not a child of the actor: Ray kills an exiting worker's child processes
and process group), so it outlives the actor it watches.
"""

import os
import select
import shutil
import sys
import time
from typing import List


def _wait_exited(pid: int, pidfd: int) -> None:
    """Returns once process ``pid`` has exited (``pidfd``: its pidfd, or -1
    where the kernel has none: then polled)."""
    if pidfd >= 0:
        select.select([pidfd], [], [])
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:  # pragma: no cover - a reused pid of another user: ours is gone
            return
        time.sleep(0.05)


def main(argv: List[str]) -> int:
    """See the module's docstring."""
    if len(argv) < 3:
        sys.stderr.write("usage: _ray_reaper.py PID FD FOLDER...\n")
        return 2
    pid, fd, folders = int(argv[0]), int(argv[1]), argv[2:]
    # Opened before detaching: the process is the actor's child, so its pid
    # cannot name another process yet.
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = -2  # exited already
    except (AttributeError, OSError):
        pidfd = -1
    if os.fork() > 0:
        os._exit(0)  # the actor reaps this intermediate at once
    os.setsid()
    while os.read(fd, 4096):  # the actor never writes: end-of-file when it ends
        pass
    if pidfd != -2:
        _wait_exited(pid, pidfd)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
