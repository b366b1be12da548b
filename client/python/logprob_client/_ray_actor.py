"""The Ray actor of ``logprob_client.ray``: one logprob- process on a node.

This module imports only the standard library and Ray, and
``logprob_client.ray`` registers it with cloudpickle to be pickled by value:
Ray ships its code to the actors with the actor class, so a node needs
neither this package nor its generated stubs (a ``ray start`` cluster's
workers do not see the driver's ``PYTHONPATH``).
"""

import ctypes
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, Optional, Sequence

import ray

from . import _ray_reaper

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The reaper's code, run as ``python -I -c`` (the actor's node may not have this package).
_REAPER_SOURCE = inspect.getsource(_ray_reaper)


def _node_ip() -> str:
    """The IP address of the Ray node this process runs on (the node's
    NodeManagerAddress: what Ray's other nodes reach it at)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def _find_binary(program: str, bin_dir: Optional[str]) -> str:
    """``program`` in ``bin_dir``, ``LOGPROB_BIN_DIR`` or ``PATH``, on this
    node; FileNotFoundError naming the node and the places searched."""
    places = [d for d in (bin_dir, os.environ.get("LOGPROB_BIN_DIR")) if d]
    for d in places:
        path = os.path.join(d, program)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(program)
    if found:
        return found
    raise FileNotFoundError(
        "%s not found on node %s (searched %s and PATH=%s): run the workers in the logprob-service image, or "
        "pass bin_dir= / set LOGPROB_BIN_DIR to the folder holding logprob-server and logprob-worker on every node"
        % (program, _node_ip(), ", ".join(places) or "no bin_dir", os.environ.get("PATH", "")))


def _reserve_port(host: str, port: int = 0) -> int:
    """``port`` (0: one the kernel picks) of ``host`` if it is free now;
    OSError naming the host and port when it is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(e.errno, "port %d of %s is not free on node %s: %s"
                          % (port, host, _node_ip(), e.strerror)) from e
        return int(s.getsockname()[1])


def _wildcard(ip: str) -> str:
    """The wildcard address of ``ip``'s family, as gRPC's HOST:PORT writes it."""
    return "[::]" if ":" in ip else "0.0.0.0"


def _shm_root() -> str:
    """Where the front-end's lm_head store goes: /dev/shm (memory) when
    usable, else the temporary folder (the server's own fallback)."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else tempfile.gettempdir()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor's process exits,
    and a process group of its own (stop() signals the group)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(127)  # never run a process that could outlive its actor
    os.setsid()


class _ProcessActor:
    """A Ray actor owning one logprob- process on its node. The process is
    started in ``__init__``, so a restarted actor (``max_restarts``) starts
    it again. ``args`` may hold ``{node_ip}``, ``{listen_host}`` (the
    node's IP, or with ``listen_wildcard`` the wildcard address of its
    family), ``{port0}``, ``{port1}``, ... (``ports``: the given ports of
    the node, each checked free; 0: a free one chosen here),
    ``{secret_file}`` (``pool_secret`` in a 0600 file) and ``{store_dir}``
    (a fresh folder under /dev/shm). Its output goes to a log file on the
    node (``log_tail``). The folders it makes (0700, one per start of the
    actor) are removed by ``stop``, and otherwise when the actor ends however
    it ends (a killed driver, ``ray.kill``, SIGKILL) by a reaper process
    (``_ray_reaper.py``) once the logprob- process has exited. With
    ``exit_with_process``, the actor exits when its process does (other
    than by ``stop``), so that Ray restarts it (``max_restarts``) and with
    it the process."""

    def __init__(self, program: str, args: Sequence[str], bin_dir: Optional[str], ports: Sequence[int] = (),
                 exit_with_process: bool = False, pool_secret: Optional[str] = None,
                 listen_wildcard: bool = False) -> None:
        self._ip = _node_ip()
        binary = _find_binary(program, bin_dir)
        listen_host = _wildcard(self._ip) if listen_wildcard else self._ip
        # Checked where the process will listen: {port0} on listen_host, the others on the node's IP.
        self._ports = [_reserve_port(listen_host.strip("[]") if i == 0 else self._ip, p)
                       for i, p in enumerate(ports)]
        subst = {"{node_ip}": self._ip, "{listen_host}": listen_host}
        subst.update({"{port%d}" % i: str(p) for i, p in enumerate(self._ports)})
        # Private to this user (the pool secret, the lm_head versions).
        prefix = "logprob-ray-%s-%s-" % (program, ray.get_runtime_context().get_actor_id())
        self._dirs = [tempfile.mkdtemp(prefix=prefix)]
        proc = None
        try:
            if any("{store_dir}" in a for a in args):
                self._dirs.append(tempfile.mkdtemp(prefix=prefix + "store-", dir=_shm_root()))
                subst["{store_dir}"] = self._dirs[-1]
            if pool_secret is not None:
                # The pool secret came through Ray's own channel (the actor's
                # arguments); the process reads it from a 0600 file, never argv.
                secret_file = os.path.join(self._dirs[0], "pool-secret")
                fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(pool_secret)
                subst["{secret_file}"] = secret_file
            self._argv = [binary]
            for a in args:
                for k, v in subst.items():
                    a = a.replace(k, v)
                self._argv.append(a)
            self._log_path = os.path.join(self._dirs[0], "output.log")
            self._stopping = False
            with open(self._log_path, "ab") as log:
                # Ray runs an actor's __init__ and methods (max_concurrency 1) on
                # its process's main thread, so PR_SET_PDEATHSIG fires when the
                # actor process ends, not when some thread of it does.
                proc = subprocess.Popen(self._argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        preexec_fn=_die_with_parent)
            self._start_reaper(proc.pid)
        except BaseException:
            if proc is not None:
                proc.kill()
                proc.wait()
            for d in self._dirs:
                shutil.rmtree(d, ignore_errors=True)
            raise
        self._proc = proc
        if exit_with_process:
            threading.Thread(target=self._exit_with_process, daemon=True).start()

    def _start_reaper(self, pid: int) -> None:
        """Starts the reaper of this actor's folders: it holds the read end
        of a pipe whose write end only this actor process holds (not
        inherited by the logprob- process), so it reads end-of-file when
        the actor ends."""
        read_end, self._reaper_pipe = os.pipe()
        try:
            reaper = subprocess.Popen([sys.executable, "-I", "-c", _REAPER_SOURCE, str(pid), str(read_end)]
                                      + self._dirs,
                                      pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read_end)
        if reaper.wait() != 0:  # the intermediate process exits at once, the reaper goes on detached
            raise RuntimeError("the folder reaper (%s -c ...) failed with status %s"
                               % (sys.executable, reaper.returncode))

    def _exit_with_process(self) -> None:
        """Ends the actor's process when the owned process ends unasked."""
        code = self._proc.wait()
        if not self._stopping:
            sys.stderr.write("logprob_client.ray: %s exited with status %s; ending the actor so Ray restarts it\n%s"
                             % (self._argv[0], code, self.log_tail()))
            sys.stderr.flush()
            os._exit(1)

    def info(self) -> Dict[str, Any]:
        """node_ip, ports, pid, argv, returncode (None while running),
        node_id, log (the output file on the node), dirs (the folders this
        actor made on the node: the log's, then the store's if any)."""
        return {"node_ip": self._ip, "ports": list(self._ports), "pid": self._proc.pid, "argv": list(self._argv),
                "returncode": self._proc.poll(), "node_id": ray.get_runtime_context().get_node_id(),
                "log": self._log_path, "dirs": list(self._dirs)}

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The last ``max_bytes`` of the process's output."""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode(errors="replace")
        except OSError as e:
            return "(no log: %s)" % e

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM to the process group, SIGKILL after ``timeout`` s; the
        exit status. Removes the actor's folders."""
        self._stopping = True
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            except ProcessLookupError:
                self._proc.wait()
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        return self._proc.returncode
