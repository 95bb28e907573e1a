"""A test-only fork server for `python -m lit_lm` and `python SCRIPT.py`: the suite's CLI and script runs start in
a fraction of a second instead of the ~8 s a fresh interpreter spends importing torch, Lightning and jsonargparse.

    done = subprocess.run([cli_server.python(), "-m", "lit_lm", "fit", ...], capture_output=True, ...)
    done = subprocess.run([cli_server.python(), "scripts/ckpt.py", "inspect", ...], capture_output=True, ...)

`python()` is the path of a small executable (a "shim", written per test worker) that behaves as the real
interpreter: `shim -m lit_lm ARGS` connects to this worker's server, passes it its stdin/stdout/stderr (the file
descriptors themselves), working directory, environment and arguments, and the server forks a child of itself (it
imported `lit_lm.cli` once) that runs `python -m lit_lm ARGS` exactly as runpy would in a fresh process (`shim
SCRIPT.py ARGS`: the script as `python SCRIPT.py ARGS` runs it, its folder first on sys.path). The shim forwards the
signals it gets to that child and exits as the child did (its status, or the same signal); the child takes the
shim's umask. `shim -c CODE ARGS` runs the code so too (the tests' hand-launched ranks); `-u` (torchrun's workers)
makes the child's stdout and stderr unbuffered. Anything else (other interpreter options) execs the real
interpreter. So `subprocess.run`'s capture, timeout (it kills
the shim; the server then kills the child) and return codes stay the real ones.

The child runs with `sys.executable` set to the shim, so Lightning's subprocess launcher (`sys.executable -m lit_lm
...` for ranks 1..N-1) starts its ranks through the server as well: the launcher and its rank processes are real,
only their imports are not paid again.

What a fresh process would see differently, and what the server does about it:
- environment variables read at import time: the server records every variable the imports read (and the
  prefixes that libraries scan); a request whose environment differs from the server's in one of them, or in a
  variable read by C code at load (OMP_*, MALLOC_*, PYTHON*, TORCH*, ...: `NATIVE_PREFIXES`), runs in a real
  interpreter instead (exec in the child), except the rank variables, whose one import-time use (Lightning's and
  torchmetrics' `rank_zero_only.rank`) is replayed;
- the hash seed (PYTHONHASHSEED) is shared by the children of one server: ranks started through the server iterate
  sets of strings in the same order, where real processes may not. The tests that keep `fresh=True` (real
  interpreters, real launcher) cover that, and `LIT_LM_TEST_FRESH=1` runs every CLI test in real interpreters;
- numpy's global generator is reseeded from the OS in the child (Python's `random` reseeds itself at fork).

The server is single-threaded (forking a threaded process is unsafe): it imports, then waits on its socket; it
exits when its test process closes its stdin (the test worker ended).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import struct
import sys
import time

SHIM_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")  # forwarded by the shim to the child
HEADER = struct.Struct("!Q")

# --- the shim (runs in a bare `python -S`: standard library only, nothing heavy) -------------------------------


def served(argv: list[str]) -> bool:
    """`-m lit_lm ...` (the user's form; Lightning's launcher's; torchrun's workers: `-u -m lit_lm ...`),
    `SCRIPT.py ...` or `-c CODE ...`."""
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    return argv[:2] in (["-m", "lit_lm"], ["-m", "lit_lm.__main__"]) or (argv[:1] == ["-c"] and len(argv) > 1) or (
        bool(argv) and not argv[0].startswith("-") and argv[0].endswith(".py"))


def shim_main(sock_path: str, real_python: str) -> None:
    argv = sys.argv[1:]
    if not served(argv):
        os.execv(real_python, [real_python, *argv])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
    except OSError:  # the server is gone: a real interpreter does the same work, slowly
        os.execv(real_python, [real_python, *argv])
    umask = os.umask(0)
    os.umask(umask)
    payload = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}).encode()
    socket.send_fds(conn, [HEADER.pack(len(payload))], [0, 1, 2])
    conn.sendall(payload)
    reader = conn.makefile("r")
    started = reader.readline()
    if not started:
        sys.exit(f"lit-lm test server at {sock_path} closed the connection")
    pid = json.loads(started)["pid"]
    for name in SHIM_SIGNALS:
        signal.signal(getattr(signal, name), lambda sig, _: os.kill(pid, sig))
    ended = reader.readline()
    if not ended:
        sys.exit(f"lit-lm test server at {sock_path} closed the connection")
    status = json.loads(ended)["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


# --- the server ---------------------------------------------------------------------------------------------------

# read by native code when a library loads (the OpenMP runtime, glibc's malloc, the interpreter, torch's C++ ...),
# out of the recorder's sight: a difference here runs the request in a real interpreter
NATIVE_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "GLIBC_", "PYTHON", "TORCH",
                   "PYTORCH_", "CUDA", "NCCL_", "GLOO_", "TRITON_", "LC_", "LANG")
# ... but read by Python code only (whose reads at import the recorder sees): the interpreter torchrun.sh and
# torchrun start (PYTHON, PYTHON_EXEC), the variables torchrun.sh and torchrun's agent give its workers
# (TORCHELASTIC_*; TORCH_DISABLE_SHARE_RDZV_TCP_STORE, read by the rendezvous; TORCH_NCCL_ASYNC_ERROR_HANDLING, read
# when a NCCL group is built)
PYTHON_READ = ("PYTHON", "PYTHON_EXEC", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
PYTHON_READ_PREFIXES = ("TORCHELASTIC_",)
# libraries that scan the whole environment at import for their own prefix (read by key, they'd mark every variable)
SCANNED_PREFIXES = {"fsspec/config.py": "FSSPEC_", "tqdm/utils.py": "TQDM_"}
# read at import only to set `rank_zero_only.rank` (lightning.fabric.utilities.rank_zero, torchmetrics): replayed
RANK_KEYS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


class _Recorder:
    """The environment variables read while importing: (key, the reading module's file) through os.environ."""

    def __init__(self) -> None:
        self.reads: set[tuple[str, str]] = set()
        recorder = self

        class Spy(type(os.environ)):
            def __getitem__(self, key):
                recorder.note(key)
                return super().__getitem__(key)

            def __contains__(self, key):
                recorder.note(key)
                return super().__contains__(key)

            def get(self, key, default=None):
                recorder.note(key)
                return super().get(key, default)

        self.original = type(os.environ)
        os.environ.__class__ = Spy

    def note(self, key: str) -> None:
        frame = sys._getframe(2)
        while frame and (frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename == os.__file__):
            frame = frame.f_back
        self.reads.add((key, frame.f_code.co_filename if frame else "?"))

    def stop(self) -> tuple[set[str], tuple[str, ...]]:
        os.environ.__class__ = self.original
        keys, prefixes = set(), set()
        for key, where in self.reads:
            scanner = next((p for f, p in SCANNED_PREFIXES.items() if where.endswith(f)), None)
            if scanner is None:
                keys.add(key)
            else:
                prefixes.add(scanner)
        return keys, tuple(prefixes)


class Server:
    def __init__(self, sock_path: str, shim: str) -> None:
        self.shim = shim
        self.log = open(os.path.join(os.path.dirname(sock_path), "requests.log"), "a")  # one line a request
        self.env = dict(os.environ)
        self.base_path = [p for p in sys.path[1:] if p not in _pythonpath(self.env)]
        recorder = _Recorder()
        try:
            import lit_lm.cli  # noqa: F401  (what `python -m lit_lm` imports before main)
            self.broken = None
        except BaseException as e:  # an edit in progress: every request runs in a real interpreter, which reports it
            self.broken = repr(e)
        self.import_keys, self.scanned = recorder.stop()
        # what the imports themselves set (a fresh process's imports would set it again over the caller's)
        self.set_by_imports = {k: v for k, v in os.environ.items() if self.env.get(k) != v}
        self.import_keys |= {k for k in self.env if k not in os.environ}  # removed by them: differs -> real one
        self.replay_ranks = self.broken is None and _rank_formula_holds()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path + ".tmp")
        self.listener.listen(64)
        os.rename(sock_path + ".tmp", sock_path)  # the path appears once it accepts
        self.children: dict[int, socket.socket] = {}
        sys.stdout.flush()
        sys.stderr.flush()

    def serve(self) -> None:
        import select

        while True:
            ready, _, _ = select.select([self.listener, sys.stdin, *self.children.values()], [], [], 0.02)
            for r in ready:
                if r is sys.stdin:
                    if not os.read(sys.stdin.fileno(), 1024):  # the test worker is gone
                        for pid in self.children:
                            _kill(pid)
                        return
                elif r is self.listener:
                    self.accept()
                else:
                    try:
                        gone = not r.recv(1)
                    except OSError:
                        gone = True
                    if gone:  # the shim was killed (a timeout): so is its child
                        pid = next(p for p, c in self.children.items() if c is r)
                        _kill(pid)
            self.reap()

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        (size,) = HEADER.unpack(header)
        payload = b""
        while len(payload) < size:
            chunk = conn.recv(size - len(payload))
            if not chunk:
                break
            payload += chunk
        request = json.loads(payload)
        pid = os.fork()
        if pid == 0:
            try:
                self.listener.close()
                for other in self.children.values():
                    other.close()
                conn.close()
                self.run_child(request, fds)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        self.children[pid] = conn

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()

    def differing(self, env: dict[str, str]) -> list[str]:
        """Variables read at import (or by native code at load) whose value differs from the server's. One the
        imports set (Lightning's PYTORCH_NVML_BASED_CUDA_CHECK, inductor's cache folder) differs only where the
        caller set it otherwise (a launched rank inherits the launcher's, set by the same imports)."""
        replayed = set(RANK_KEYS) if self.replay_ranks else set()
        if not self.shadows(_pythonpath(env)):
            replayed.add("PYTHONPATH")  # sys.path is rebuilt from it
        differ = []
        for key in sorted(set(env) | set(self.env)):
            if key in self.set_by_imports:
                if key in env and env[key] != self.set_by_imports[key]:
                    differ.append(key)
            elif env.get(key) != self.env.get(key) and key not in replayed and (
                    key in self.import_keys or key.startswith(self.scanned) or (
                        key.startswith(NATIVE_PREFIXES) and key not in PYTHON_READ
                        and not key.startswith(PYTHON_READ_PREFIXES))):
                differ.append(key)
        return differ

    def shadows(self, paths: list[str]) -> bool:
        """Whether a folder of `paths` holds a top-level module the server imported from elsewhere (a fresh
        process with that PYTHONPATH would import that one)."""
        for folder in paths:
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                module = sys.modules.get(name.removesuffix(".py"))
                where = getattr(module, "__file__", None) or ""
                if module is not None and not os.path.abspath(where).startswith(os.path.join(folder, "")):
                    return True
        return False

    def run_child(self, request: dict, fds: list[int]) -> None:
        """In the forked child: become `python -m lit_lm ARGS` (or `python SCRIPT.py ARGS`) as started by the shim,
        run it, exit as it would."""
        for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD"):
            sig = getattr(signal, name)
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        argv, env, cwd = request["argv"], request["env"], request["cwd"]
        os.chdir(cwd)
        os.umask(request["umask"])
        run = argv[1:] if argv[0] == "-u" else argv
        # the folder the interpreter puts first on sys.path: -m and -c: the cwd; a script: its (real) folder
        folder = cwd if run[0] in ("-m", "-c") else os.path.dirname(os.path.realpath(run[0]))
        why = self.broken or self.differing(env) or (self.shadows([folder]) and f"{folder} shadows an import")
        print(f"{time.strftime('%X')} {os.getpid()} rank {env.get('LOCAL_RANK', '-')}: {' '.join(argv)}: "
              f"{f'real interpreter ({why})' if why else 'forked'}", file=self.log, flush=True)
        self.log.close()
        if why:
            os.execve(sys.executable, [sys.executable, *argv], env)
        os.environ.clear()
        os.environ.update(env, **self.set_by_imports)
        if self.replay_ranks:
            _replay_ranks()
        sys.orig_argv = [sys.executable, *argv]
        if argv[0] == "-u":  # stdout and stderr unbuffered, as the flag makes them
            argv = argv[1:]
            for name, fd in (("stdout", 1), ("stderr", 2)):
                old = getattr(sys, name)
                setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                                    errors=old.errors, write_through=True))
        # sys.path[0] and sys.argv as the interpreter sets them: -m: the cwd, ["-m", ARGS]; -c: "", ["-c", ARGS];
        # a script: its folder, [SCRIPT, ARGS]
        first = "" if argv[0] == "-c" else folder
        sys.argv = [argv[0], *argv[2:]] if argv[0] in ("-m", "-c") else list(argv)
        sys.path[:] = [first, *_pythonpath(env), *self.base_path]
        sys.executable = self.shim
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        _run_as_main(*argv[:2])


def _pythonpath(env: dict[str, str]) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _rank_formula_holds() -> bool:
    """Whether the imports set `rank_zero_only.rank` the way `_replay_ranks` recomputes it (else: not replayed)."""
    try:
        expected = _rank_values()
    except (ImportError, AttributeError, ValueError):
        return False
    return all(fn.rank == value for fn, value in expected)


def _rank_values() -> list:
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only
    from torchmetrics.utilities import prints

    return [(rank_zero_only, _get_rank() or 0), (prints.rank_zero_only, int(os.environ.get("LOCAL_RANK", 0)))]


def _replay_ranks() -> None:
    for fn, value in _rank_values():
        fn.rank = value


def _run_as_main(first: str, second: str | None = None) -> None:
    """`-m MODULE`: runpy as `python -m` uses it, in a fresh `__main__`; `-c CODE`: the code run in that `__main__`
    (as "<string>"); `SCRIPT`: its code run there, its absolute path as `__file__`. Then the interpreter's exit:
    threads joined, atexit handlers run, streams flushed; the exit status as the interpreter computes it."""
    import atexit
    import builtins
    import runpy
    import threading
    import types
    from importlib.machinery import BuiltinImporter, SourceFileLoader

    main = sys.modules["__main__"] = types.ModuleType("__main__")
    code, interrupted = 0, False
    try:
        if first == "-m":
            runpy._run_module_as_main(second, alter_argv=True)
        elif first == "-c":
            main.__dict__.update(__builtins__=builtins, __loader__=BuiltinImporter)
            exec(compile(second, "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(first)
            main.__dict__.update(__file__=script, __builtins__=builtins, __cached__=None,
                                 __loader__=SourceFileLoader("__main__", script))
            with open(script, "rb") as f:
                source = f.read()
            exec(compile(source, script, "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                code = code or 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- the test side ------------------------------------------------------------------------------------------------

# import-time variables a test sets for some runs only: one server per value seen (TRITON_INTERPRET=0, the PyTorch
# reference tiles under cp as `fit` runs on CPU: tests/dist_utils.py REFERENCE_TILES; the suite's default is 1)
SERVER_KEYS = ("TRITON_INTERPRET",)
_servers: dict = {}  # their values -> (process, shim path) of this test process's server


def python(fresh: bool = False, env: dict[str, str] | None = None) -> str:
    """The interpreter to start `-m lit_lm` or a script with, in `env` (default: this process's): the shim of this
    test process's server for env's SERVER_KEYS (started, and waited for, on the first call), or the real one when
    `fresh` or LIT_LM_TEST_FRESH=1."""
    if fresh or os.environ.get("LIT_LM_TEST_FRESH", "") not in ("", "0"):
        return sys.executable
    values = tuple((os.environ if env is None else env).get(key) for key in SERVER_KEYS)
    server = _servers.get(values)
    if server is None or server[0].poll() is not None:
        server = _servers[values] = _start(dict(zip(SERVER_KEYS, values)))
    return server[1]


def _start(values: dict[str, str | None]):
    import atexit
    import subprocess
    import tempfile

    folder = tempfile.mkdtemp(prefix="lit_lm_cli_")
    sock, shim = os.path.join(folder, "server.sock"), os.path.join(folder, "python")
    with open(shim, "w") as f:
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                f"from cli_server import shim_main\nshim_main({sock!r}, {sys.executable!r})\n")
    os.chmod(shim, 0o755)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # the suite's run_cli environment
    for key, value in values.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    log = open(os.path.join(folder, "server.log"), "w")
    proc = subprocess.Popen([sys.executable, __file__, sock, shim], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=folder)
    log.close()  # the server holds its own
    atexit.register(_stop, proc)
    deadline = time.monotonic() + 600
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the lit-lm test server did not start: {open(log.name).read()[-3000:]}")
        time.sleep(0.05)
    return proc, shim


def _stop(proc) -> None:
    proc.stdin.close()  # the server's cue to exit
    try:
        proc.wait(timeout=10)
    except Exception:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    Server(sys.argv[1], sys.argv[2]).serve()
