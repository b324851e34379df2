"""`python -m MODULE ARGS` for the tests without paying a study's imports each time.

The fault tests start ~50 real studies (the every-kind kill chain alone ~35), and the others
run `python -m search`, `train` and `search.fit` too (tests/sweeps.py's run_module and
search_process, tests/test_guide.py's shell for the docs' commands). Each fresh `python -m
search` spends 8-15 s (up to 30 s beside another worker) importing torch, torchvision,
torchmetrics, MLflow and Optuna before its first journal append. Here one server process per
pytest session imports them once, then only forks: each run is a child of it with its own
pid, cwd, argv and stdio (pipes the test reads), running `runpy.run_module(MODULE,
run_name="__main__")` as `python -m MODULE` does, exiting through the interpreter's own exit
path (atexit, flushes, exit status, the SIGINT exit of an uncaught KeyboardInterrupt).
`start` gives the test a `Forked`: Popen's pid, poll, wait, send_signal, communicate and
returncode (-9 for a SIGKILL), so it kills the real process with real signals and reads what
it wrote.

    python tests/faults/forkserver.py LISTENER_FD CONTROL_FD   # started by `start`, not by hand

How a child differs from a fresh `python -m MODULE`, and why the fault tests cannot tell
(tests/faults/test_forkserver.py compares the two from inside):
- Its modules were imported before its cwd was set, in an empty directory (the server's),
  and those a study imports at first use (PRELOAD) before the run rather than during it.
  What imports do is the same in both (same interpreter, flags and environment: a server
  serves one environment, but for PER_RUN_ENV, set per child); what they print is kept and
  written first to each child's stdout/stderr, where a fresh process prints it.
- The server runs nothing but imports: no torch op (torch's OpenMP intra-op pool is not
  started, `torch.set_num_threads` and `set_num_interop_threads` act as in a fresh process),
  no CUDA (checked), no Hydra run (its global state is empty), no MLflow or Optuna call (no
  threads: checked before every fork), no signal handler or atexit of its own: a child has
  exactly the handlers, atexit callbacks and logging handlers that the imports installed.
  The imports start three native threads, which a child lacks until it needs them: the
  OpenBLAS pools of numpy and scipy (OpenBLAS stops them in its own pthread_atfork handler
  and restarts them on the next BLAS call) and pyarrow's jemalloc purging thread (jemalloc
  takes its locks across fork() and runs without it in the child).
- Random state: CPython reseeds `random` in a child, and the child reseeds numpy's global
  generator as its import does; torch's default seed is fixed in every process anyway. The
  str hash seed is the server's in every child (nothing here depends on it).
- Garbage collection: the server freezes what its imports made (`gc.freeze()`, as the gc
  module's documentation advises before a fork without exec), so a child's collections
  skip those ~700k objects instead of traversing them and copying every page they touch.
  Measured on this 2-core machine under load: a full collection in a child 0.8 s -> 0 s of
  CPU, a child's exit (the interpreter's final collections) 15 s -> 1.3 s. What changes:
  a reference cycle among objects made by the imports is never freed in a child, memory
  only (finalizers that matter are atexit callbacks, which run).
- Its parent is the server (os.getppid(); nothing in batchfit reads it), which reaps it and
  only then reports its status: like Popen's, a returned status means /proc holds no
  zombie, so a resume that checks whether the dead owner's pid lives sees it gone.
- Stdio: the server starts with pipes for stdout/stderr and pytest's stdin, as a run does,
  so Python's stdio objects were set up for pipes (block-buffered stdout, not seekable,
  not a terminal); a child's fds 0-2 are its own, and it holds no other fd of the server's.
BATCHFIT_FORKSERVER=0 runs every study as a fresh `python -m` instead (to compare).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# A study's imports: its entry point's, and what MLflow's sqlite store and the digits data
# import at first use (a third of the time). `python -m search` runs the thin search/__main__.py,
# which imports batchfit.search.__main__: preloaded, as a module `python -m` does not run itself.
PRELOAD = ("batchfit.search.__main__", "mlflow.store.tracking.sqlalchemy_store", "sklearn.datasets")
IMPORT_OUTPUT = ("imports.out", "imports.err")  # in the server's directory
# Set by pytest for each test: a child takes the value of its request (nothing imports it).
PER_RUN_ENV = ("PYTEST_CURRENT_TEST",)
REAP_POLL_S = 0.02  # how often the server looks for children that exited
START_TIMEOUT_S = 300  # the first run waits for the server's imports


# The server: imports once, forks a child per request, reports its exit status.


@dataclass(frozen=True)
class Request:
    module: str
    args: list[str]
    cwd: str
    env: dict[str, str | None]  # PER_RUN_ENV's values (None: unset)


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _capture_import_output() -> None:
    """Whatever importing prints goes to files, to be written to each child's stdio."""
    for fd, name in zip((1, 2), IMPORT_OUTPUT, strict=True):
        with open(name, "wb") as file:
            os.dup2(file.fileno(), fd)


def import_preloaded() -> None:
    """PRELOAD imported: the modules a child starts with."""
    for name in PRELOAD:
        importlib.import_module(name)


def _forget(name: str) -> None:
    parent, _, child = name.rpartition(".")
    del sys.modules[name]
    delattr(sys.modules[parent], child)


def _preload() -> tuple[bytes, bytes]:
    import_preloaded()
    sys.stdout.flush()
    sys.stderr.flush()
    return tuple(Path(name).read_bytes() for name in IMPORT_OUTPUT)


def _check_fork_safe(native: set[str]) -> None:
    """Fork copies only the calling thread: another thread's locks would stay held in the
    child. Only the native pools the imports started (see the docstring) may exist."""
    python = threading.enumerate()
    new = _tasks() - native
    if len(python) > 1 or new:
        raise RuntimeError(
            f"the fork server has threads a child cannot inherit: {python}, OS tasks {new}; "
            "something ran in it besides imports. Run with BATCHFIT_FORKSERVER=0 meanwhile"
        )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("the fork server initialised CUDA, which a forked child cannot use")


def serve(listener_fd: int, control_fd: int) -> tuple[Request, tuple[bytes, bytes]] | None:
    """Forks a child per connection on the listener until the control pipe closes; returns
    in each child (its request and the imports' output), None in the server when done."""
    _capture_import_output()
    imports_output = _preload()
    gc.freeze()  # see the docstring: Garbage collection
    native = _tasks()
    listener = socket.socket(fileno=listener_fd)
    control = os.fdopen(control_fd, "rb", buffering=0)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(control, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(REAP_POLL_S if running else None):
            if key.fileobj is control:
                if not control.read(1):  # the tests are done (or pytest died)
                    return None
                continue
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            _check_fork_safe(native)
            pid = os.fork()
            if pid == 0:
                for each in (selector, listener, control, conn, *running.values()):
                    each.close()
                _become(fds)
                return Request(**json.loads(message)), imports_output
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode())
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid)
            with contextlib.suppress(OSError):  # the test may have stopped waiting for it
                conn.sendall(json.dumps({"status": status}).encode())
            conn.close()


def _become(fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS's entropy, as importing numpy seeds it


def run_child(request: Request, imports_output: tuple[bytes, bytes]) -> None:
    """The rest of `python -m MODULE ARGS` in CWD, in this child; its exit is the
    interpreter's."""
    os.chdir(request.cwd)
    sys.path[0] = os.getcwd()  # `python -m` puts the cwd first
    for name, value in request.env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for fd, data in zip((1, 2), imports_output, strict=True):
        os.write(fd, data)
    sys.argv = [request.module, *request.args]  # run_module sets argv[0] to the file
    # A plain module (not a package, whose __main__ runs) that the preloaded imports imported
    module = sys.modules.get(request.module)
    if "." in request.module and module is not None and not hasattr(module, "__path__"):
        _forget(request.module)  # as `python -m` finds it: not imported (runpy warns)
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


# The tests' side: a server per environment, started at first use.


class Forked:
    """A child of the fork server, used as a `subprocess.Popen(text=True, stdout=PIPE,
    stderr=PIPE)` is: the pid is the real process's, its status is reported by the server."""

    def __init__(self, args: list[str], conn: socket.socket, stdout: int, stderr: int) -> None:
        self.args = args
        self._conn = conn
        conn.settimeout(START_TIMEOUT_S)
        reply = conn.recv(4096)
        if not reply:
            raise RuntimeError("the fork server died before forking; it said:")
        self.pid = json.loads(reply)["pid"]
        # As Popen(text=True) makes them: decoded with the locale's encoding.
        self.stdout = io.TextIOWrapper(open(stdout, "rb"))  # noqa: SIM115 - closed by communicate
        self.stderr = io.TextIOWrapper(open(stderr, "rb"))  # noqa: SIM115
        self.returncode: int | None = None

    def _status(self, timeout_s: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout_s)
            try:
                reply = self._conn.recv(4096)
            except (BlockingIOError, TimeoutError):
                return None
            if not reply:
                raise RuntimeError(f"the fork server died while running {self.args}")
            self.returncode = os.waitstatus_to_exitcode(json.loads(reply)["status"])
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may be another process's by now
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes read to their end, then the exit status; as Popen's, what a
        `readline()` on `stdout` already buffered is not returned again."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[int, list[bytes]] = {self.stdout.fileno(): [], self.stderr.fileno(): []}
        with selectors.DefaultSelector() as selector:
            for pipe in (self.stdout, self.stderr):
                if not pipe.closed:
                    selector.register(pipe.fileno(), selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        texts = []
        for pipe in (self.stdout, self.stderr):  # decoded as Popen does (universal newlines)
            text = b"".join(chunks[pipe.fileno()]).decode(pipe.encoding, pipe.errors)
            texts.append(text.replace("\r\n", "\n").replace("\r", "\n"))
            pipe.close()
        return texts[0], texts[1]


Process = Forked | subprocess.Popen  # what `start` gives


class ForkServer:
    def __init__(self, env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="batchfit-forkserver-"))
        self.address = str(self.folder / "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.address)
        listener.listen(64)
        control, self._control = os.pipe()  # closed by pytest's exit, however it exits
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(listener.fileno()), str(control)],
            cwd=self.folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(listener.fileno(), control),
        )  # fmt: skip
        listener.close()
        os.close(control)

    def start(self, module: str, args: list[str], cwd: Path, env: dict[str, str]) -> Forked:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.address)
        except OSError as error:
            raise RuntimeError(f"the fork server is gone ({error}): {self.output()}") from None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        per_run = {name: env.get(name) for name in PER_RUN_ENV}
        request = {"module": module, "args": args, "cwd": str(cwd), "env": per_run}
        socket.send_fds(conn, [json.dumps(request).encode()], [0, out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        try:
            return Forked([sys.executable, "-m", module, *args], conn, out_r, err_r)
        except RuntimeError as error:
            raise RuntimeError(f"{error}\n{self.output()}") from None

    def output(self) -> str:
        """What the server said (before its imports) and what its imports printed."""
        done = self.process.poll() is not None
        pipes = (self.process.stdout, self.process.stderr) if done else ()
        files = [self.folder / name for name in IMPORT_OUTPUT]
        said = [pipe.read().decode(errors="replace") for pipe in pipes]
        printed = [file.read_text(errors="replace") for file in files if file.exists()]
        return "\n".join(said + printed)

    def stop(self) -> None:
        os.close(self._control)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.process.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}


def _stop_all() -> None:
    for server in _servers.values():
        server.stop()
    _servers.clear()


def start(module: str, args: list[str], cwd: Path, env: dict[str, str]) -> Process:
    """`python -m MODULE ARGS` in cwd with env, its output piped as text: a child of the
    fork server for that environment (but for PER_RUN_ENV)."""
    if os.environ.get("BATCHFIT_FORKSERVER") == "0":
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=cwd, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    key = tuple(sorted((k, v) for k, v in env.items() if k not in PER_RUN_ENV))
    if key not in _servers:
        if not _servers:
            atexit.register(_stop_all)
        _servers[key] = ForkServer(env)
    return _servers[key].start(module, args, cwd, env)


def run(
    module: str, args: list[str], cwd: Path, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True, timeout=timeout_s) of `start`."""
    process = start(module, args, cwd, env)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def main() -> None:
    # Started by its path, so that the environment served need not have tests/ importable
    # (a user's has not); the import path as `python -m` makes it, the cwd first.
    sys.path[0] = os.getcwd()
    child = serve(int(sys.argv[1]), int(sys.argv[2]))
    if child is not None:
        run_child(*child)


if __name__ == "__main__":
    main()
