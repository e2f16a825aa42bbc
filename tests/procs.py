"""Training subprocesses without paying for ``import lightning`` each time: a fork server for the suite.

A test that kills, signals or runs DDP needs a real process, and every such process used to start a fresh
interpreter and import torch, ``torch._dynamo`` (which Lightning imports) and Lightning: about 6 s of CPU on these
cores before its first line, most of the suite's time. Here each pytest worker starts one server (this file, run as
a script) that imports them once and then forks a child per request: the child is set up as ``python SCRIPT ARGS``
would be (its own environment, working folder, ``sys.path``, ``sys.argv``, standard streams, session, warning
options, temp folder, Lightning's rank, torch's thread count, fresh NumPy and torch entropy) and runs the script with
:mod:`runpy`. It is a real process: SIGKILL, SIGTERM, process groups, exit statuses and pipes behave as they do for
:class:`subprocess.Popen`. Lightning's DDP launcher in a child forks ranks 1..N-1 the same way, from a clean copy of
the child taken before its script ran (see :func:`_rank_server`), in the child's own process group.

What a forked child shares with the server, unlike a fresh interpreter:

- the modules imported before the fork (only third-party ones: torch, Lightning, NumPy, the store clients; never
  ``lightning_resilient``, which each child imports from its own ``sys.path``), with the environment they read at
  their import beyond what is listed above: a test that sets such a variable must use :func:`subprocess.Popen`
  (so must a test that checks what a script imports);
- the hash seed (``PYTHONHASHSEED`` cannot change after start);
- the processes a child starts other than Lightning's DDP ranks (torchrun's workers, multiprocessing's spawn) are
  fresh interpreters.

``popen`` and ``run`` take the arguments of :class:`subprocess.Popen` and :func:`subprocess.run` the suite uses;
a command that is not ``[sys.executable, SCRIPT or -m MODULE, ...]`` goes to :mod:`subprocess` unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import IO, Any

# Imported once by the server; a child's own imports of them are then free.
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.distributed", "lightning.pytorch",
           "lightning.fabric.strategies.launchers.subprocess_script",
           "lightning.pytorch.strategies.launchers.subprocess_script", "fsspec", "s3fs", "gcsfs",
           "botocore.session", "aiobotocore.session", "psutil")
_STREAMS = 3  # stdin, stdout, stderr


# -- the client side (pytest's process) --------------------------------------------------------------------------

class _Server:
    """This process's fork server: started on first use, ended with this process (it watches its stdin)."""

    lock = threading.Lock()
    current: _Server | None = None

    def __init__(self) -> None:
        self.path = _socket_name()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path[1:]], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"READY":
            raise RuntimeError(f"the fork server did not start (it said {line!r}, exit {self.proc.poll()})")

    @classmethod
    def get(cls) -> _Server:
        with cls.lock:
            if cls.current is None or cls.current.proc.poll() is not None:
                cls.current = _Server()
            return cls.current


def server_pids() -> set[int]:
    """The fork servers of this process (the suite's stray-process check leaves them alone)."""
    server = _Server.current
    return {server.proc.pid} if server is not None and server.proc.poll() is None else set()


def _supported(args: Any) -> bool:
    if not isinstance(args, (list, tuple)) or len(args) < 2 or args[0] != sys.executable:
        return False
    rest = [a for a in args[1:] if a != "-u"]
    return bool(rest) and ((rest[0] == "-m" and len(rest) > 1) or not str(rest[0]).startswith("-"))


def _stream(spec: Any, default: int, closing: list[int]) -> tuple[int, int | None]:
    """The fd the child gets for one stream, and the parent's end of a new pipe (or None)."""
    if spec is None:
        return default, None
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        child, mine = (read, write) if default == 0 else (write, read)
        closing.append(child)  # (ours once the server has it)
        return child, mine
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        closing.append(fd)
        return fd, None
    if isinstance(spec, int):
        return spec, None
    return spec.fileno(), None


class Process:
    """What :func:`popen` returns: the parts of :class:`subprocess.Popen` the suite uses, for a forked child."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Any = None,
                 stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool = False,
                 start_new_session: bool = False, server: str | None = None) -> None:
        self.args = args
        self.returncode: int | None = None
        closing: list[int] = []
        try:
            fd_in, mine_in = _stream(stdin, 0, closing)
            fd_out, mine_out = _stream(stdout, 1, closing)
            if stderr == subprocess.STDOUT:
                fd_err, mine_err = fd_out, None
            else:
                fd_err, mine_err = _stream(stderr, 2, closing)
            request = json.dumps({"argv": [str(a) for a in args[1:]], "env": dict(env if env is not None
                                                                                    else os.environ),
                                  "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                                  "new_session": start_new_session, "ranks": server is None}).encode()
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.connect(server if server is not None else _Server.get().path)
            socket.send_fds(self._sock, [struct.pack("!Q", len(request))], [fd_in, fd_out, fd_err])
            self._sock.sendall(request)
        finally:
            for fd in closing:
                os.close(fd)
        self._buffer = b""
        self.pid = int(self._message(None)["pid"])

        def wrap(fd: int | None, mode: str) -> IO[Any] | None:
            if fd is None:
                return None
            if text:
                return open(fd, mode, encoding=None, errors=None)
            return open(fd, mode + "b", buffering=-1)

        self.stdin = wrap(mine_in, "w")
        self.stdout = wrap(mine_out, "r")
        self.stderr = wrap(mine_err, "r")

    def _message(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._sock.settimeout(left)
            try:
                got = self._sock.recv(4096)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            if not got:
                raise RuntimeError(f"the fork server went away while {self.args} ran")
            self._buffer += got
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._message(timeout)["returncode"])
            self._sock.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(timeout=0.001)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if input is not None:
            assert self.stdin is not None
            self.stdin.write(input)
        if self.stdin is not None:
            self.stdin.close()
        results: dict[str, Any] = {}
        readers = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                thread = threading.Thread(target=lambda n=name, s=stream: results.__setitem__(n, s.read()),
                                          daemon=True)
                thread.start()
                readers.append(thread)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in readers:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.001, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(args: list[str], **kwargs: Any) -> Any:
    """:class:`subprocess.Popen` (the arguments the suite uses), forked from this worker's server when ``args`` is
    ``[sys.executable, SCRIPT or -m MODULE, ...]``."""
    if not _supported(args) or set(kwargs) - {"env", "cwd", "stdin", "stdout", "stderr", "text",
                                              "start_new_session"}:
        return subprocess.Popen(args, **kwargs)
    return Process(list(args), **kwargs)


def run(args: list[str], *, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        input: Any = None, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` over :func:`popen`."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs.update(stdin=subprocess.PIPE)
    proc = popen(args, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# What a script that calls ``subprocess.Popen``/``subprocess.run`` through its module global ``subprocess`` can be
# given instead (the benchmark smoke tests: their workers are forked, their servers started as before).
SUBPROCESS = types.SimpleNamespace(Popen=popen, run=run, PIPE=subprocess.PIPE, DEVNULL=subprocess.DEVNULL,
                                   STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired,
                                   CalledProcessError=subprocess.CalledProcessError,
                                   CompletedProcess=subprocess.CompletedProcess)


# -- the server side ---------------------------------------------------------------------------------------------

def _socket_name() -> str:
    """A name in Linux's abstract socket namespace: nothing on disk (tests list their temp folders)."""
    return f"\0lightning-resilient-procs-{os.getpid()}-{os.urandom(6).hex()}"


def _listen(name: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(64)
    return listener


def _read_request(conn: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One request (its length, the three stream fds, then its JSON); None when the connection ends before it does."""
    conn.setblocking(True)
    head, fds, _, _ = socket.recv_fds(conn, 8, _STREAMS)
    while 0 < len(head) < 8:
        more = conn.recv(8 - len(head))
        if not more:
            break
        head += more
    if len(head) < 8:
        return None, fds
    (size,) = struct.unpack("!Q", head)
    body = b""
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            return None, fds
        body += more
    return json.loads(body), fds


def _serve(listener: socket.socket, until: int, is_stdin: bool) -> dict[str, Any]:
    """Fork a child per request until ``until`` says to stop (stdin at its end, or the pidfd of the process this
    server works for: it ended); returns only in a child, with its request."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(until, selectors.EVENT_READ, "until")
    waiting: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the requester's connection)
    while True:
        for key, _ in selector.select():
            if key.data == "until":
                if not is_stdin or not os.read(until, 4096):
                    os._exit(0)
            elif key.data == "accept":
                conn, _ = listener.accept()
                request, fds = _read_request(conn)
                if request is None:  # the requester went away mid-request: nothing to start
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                ready, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready)
                    selector.close()
                    listener.close()
                    if not is_stdin:
                        os.close(until)
                    for pidfd, (_, other) in waiting.items():
                        os.close(pidfd)
                        other.close()
                    conn.close()
                    request["fds"], request["ready"] = fds, ready_w
                    return request  # type: ignore[no-any-return]
                os.close(ready_w)
                for fd in fds:
                    os.close(fd)
                # As Popen returns once its child runs: the requester may signal the child's group at once.
                os.read(ready, 1)  # (empty if the child died first)
                os.close(ready)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                pidfd = os.pidfd_open(pid)
                waiting[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ, "child")
            else:
                pidfd = key.fd
                selector.unregister(pidfd)
                pid, conn = waiting.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                conn.close()


def _rank_server(base_path: list[str]) -> str:
    """Fork, before the script runs, a server of this child's own: Lightning's DDP launcher in the script then forks
    its ranks 1..N-1 from it (clean copies, in this child's session and process group, so that a kill of the group
    reaches them as it reaches subprocesses) instead of starting fresh interpreters. It ends with this child."""
    name = _socket_name()
    listener = _listen(name)
    me = os.getpid()
    if os.fork() == 0:
        request = _serve(listener, os.pidfd_open(me), is_stdin=False)
        _become(request, base_path)  # (a rank: it serves no ranks of its own)
        raise AssertionError("unreachable")
    listener.close()
    return name


def _fork_lightning_ranks(server: str) -> None:
    """Have Lightning's DDP launchers (fabric's and the trainer's) start ranks 1..N-1 through ``server``."""

    def start(args: Any, **kwargs: Any) -> Any:
        if _supported(args) and not set(kwargs) - {"env", "cwd", "stdin", "stdout", "stderr", "text"}:
            return Process(list(args), server=server, **kwargs)
        return subprocess.Popen(args, **kwargs)

    shim = types.SimpleNamespace(**{**SUBPROCESS.__dict__, "Popen": start})
    for name in ("lightning.fabric.strategies.launchers.subprocess_script",
                 "lightning.pytorch.strategies.launchers.subprocess_script"):
        module = sys.modules.get(name)
        if module is not None:
            module.subprocess = shim  # type: ignore[attr-defined]


def _become(request: dict[str, Any], base_path: list[str]) -> None:
    """Turn this forked server into ``python ARGV`` as the request describes, and run it."""
    import runpy
    import warnings

    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
    for fd in set(request["fds"]):
        if fd > 2:
            os.close(fd)
    os.write(request["ready"], b"1")  # session and streams are in place (see _serve)
    os.close(request["ready"])
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # (tempfile caches TMPDIR: a node's own temp folder is how tests give it its own disk)
    os.chdir(request["cwd"])
    argv = list(request["argv"])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    while argv and argv[0] == "-u":
        argv.pop(0)
        unbuffered = True
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if env.get("PYTHONWARNINGS"):
        sys.warnoptions[:] = env["PYTHONWARNINGS"].split(",")
        warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:  # Lightning reads the rank from RANK, LOCAL_RANK, ... once, at its import
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
    # A fresh interpreter seeds NumPy's and torch's global generators from the OS (Python's random reseeds itself
    # after a fork): each child draws its own numbers, not the server's.
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
        if env.get("OMP_NUM_THREADS", "").isdigit():  # (read by the OpenMP runtime at the server's start)
            sys.modules["torch"].set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    if request.get("ranks"):
        _fork_lightning_ranks(_rank_server(base_path))
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[:] = [os.getcwd(), *extra, *base_path]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[:] = [os.path.dirname(script), *extra, *base_path]
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main() -> None:
    name = "\0" + sys.argv[1]  # (abstract: see _socket_name)
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    here = os.path.dirname(os.path.abspath(__file__))
    base_path = [p for p in sys.path if p not in own and p != here and p != ""]
    for module in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(module)
    # Nothing that runs threads may be imported here: a fork keeps only the forking thread.
    assert threading.active_count() == 1, [t.name for t in threading.enumerate()]
    assert not [m for m in sys.modules if m.split(".")[0] in ("lightning_resilient", "tests")]
    listener = _listen(name)
    sys.stdout.buffer.write(b"READY\n")
    sys.stdout.flush()
    request = _serve(listener, sys.stdin.fileno(), is_stdin=True)
    _become(request, base_path)


if __name__ == "__main__":
    main()
