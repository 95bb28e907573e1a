"""tests/cli_server.py, the suite's preloaded `python -m lit_lm`: a run through it reads as a fresh interpreter's
(same stdout, stderr and exit status), a signal or a timeout ends its forked child, and a variable the imports read
that differs from the server's sends the run to a real interpreter."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import cli_server
import pytest

ERROR = ("fit", "--trainer.max_stepz", "3")  # refused before any Trainer: one line, exit 2


def _log() -> Path:
    return Path(cli_server.python()).parent / "requests.log"


def _run(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([cli_server.python(), "-m", "lit_lm", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env), timeout=300)


def _child(mark: str, timeout: float = 30) -> int:
    """The pid of the forked child whose request line names `mark`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(rf"^\S+ (\d+) .*{re.escape(mark)}.*: forked$", _log().read_text(), re.M)
        if found:
            return int(found[-1])
        time.sleep(0.05)
    raise AssertionError(f"no forked request for {mark}: {_log().read_text()[-2000:]}")


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # dead, not yet reaped by the server
            return True
        time.sleep(0.05)
    return False


def test_a_run_through_the_server_reads_as_a_fresh_interpreters(tmp_path):
    served = _run(*ERROR, cwd=tmp_path)
    # HF_HOME is read when huggingface_hub is imported (through Lightning): a different one cannot be forked
    fresh = _run(*ERROR, cwd=tmp_path, HF_HOME=str(tmp_path / "hf"))
    lines = _log().read_text().splitlines()
    assert (lines[-2].endswith("max_stepz 3: forked")
            and lines[-1].endswith("max_stepz 3: real interpreter (['HF_HOME'])"))
    assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert served.returncode == 2 and served.stderr.startswith("lit-lm: error: ") and "max_stepz" in served.stderr


def _blocked(tmp_path: Path, name: str) -> list[str]:
    """A `fit` that waits: its config is a named pipe no one writes (read before anything else)."""
    fifo = tmp_path / name
    os.mkfifo(fifo)
    return [cli_server.python(), "-m", "lit_lm", "fit", "--config", str(fifo)]


def test_a_signal_to_the_shim_ends_the_child_with_it(tmp_path):
    shim = subprocess.Popen(_blocked(tmp_path, "signalled.yaml"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    child = _child("signalled.yaml")
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=30) == -signal.SIGTERM
    assert _gone(child)


def test_a_timeout_kills_the_child(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(_blocked(tmp_path, "timed_out.yaml"), cwd=tmp_path, capture_output=True, timeout=3,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert _gone(_child("timed_out.yaml"))


def test_a_launched_rank_knows_its_rank_from_the_start(tmp_path):
    """Lightning reads the rank variables once, at import (`rank_zero_only.rank`): a rank the launcher started
    through the server gets them replayed, so a config error is printed by rank 0 only, as by fresh processes."""
    from test_cli import tiny_args

    bad = [*tiny_args(tmp_path), "--model.init_args.config.n_heads", "5"]
    rank1 = _run("fit", *bad, cwd=tmp_path, LOCAL_RANK="1")
    served = [line for line in _log().read_text().splitlines() if str(tmp_path) in line]  # other tests share the log
    assert served and served[-1].endswith("n_heads 5: forked") and "rank 1:" in served[-1], served
    assert rank1.returncode == 2 and "lit-lm: error" not in rank1.stderr, rank1.stderr[-3000:]
    assert "n_heads" in _run("fit", *bad, cwd=tmp_path).stderr


SCRIPT = """import json, os, sys
umask = os.umask(0)
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__, "cwd": os.getcwd(),
                  "umask": umask, "spec": __spec__}))
sys.exit(3)
"""


def test_a_script_run_through_the_server_reads_as_a_fresh_interpreters(tmp_path):
    """`shim SCRIPT.py ARGS` (scripts/*.py in the tests): the script's argv, folder first on sys.path, __file__,
    __main__, cwd, the caller's umask and exit status, as a real interpreter gives them."""
    import sys

    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "tool.py").write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def run(python: str) -> subprocess.CompletedProcess:
        return subprocess.run([python, "tools/tool.py", "a b", "--c"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300, preexec_fn=lambda: os.umask(0o027))

    served, fresh = run(cli_server.python()), run(sys.executable)
    assert _log().read_text().splitlines()[-1].endswith("tools/tool.py a b --c: forked")
    assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert served.returncode == 3 and '"umask": 23' in served.stdout and f'"path0": "{tmp_path}/tools"' in served.stdout


def test_python_c_through_the_server_reads_as_a_fresh_interpreters(tmp_path):
    """`shim -c CODE ARGS` (test_crash's hand-launched ranks): argv, sys.path[0] (""), __name__, an uncaught
    exception's traceback and exit status 1, as a real interpreter gives them."""
    import sys

    code = "import json, sys; print(json.dumps([sys.argv, sys.path[0], __name__, __spec__])); sys.stdout.flush(); 1/0"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    served, fresh = (subprocess.run([python, "-c", code, "a b", "--c"], cwd=tmp_path, env=env, capture_output=True,
                                    text=True, timeout=300) for python in (cli_server.python(), sys.executable))
    assert _log().read_text().splitlines()[-1].endswith(" a b --c: forked")
    assert ((served.returncode, served.stdout) == (fresh.returncode, fresh.stdout)
            == (1, '[["-c", "a b", "--c"], "", "__main__", null]\n'))
    assert served.stderr.endswith(fresh.stderr.split("\n", 1)[1]) and "ZeroDivisionError" in served.stderr


def test_a_folder_that_shadows_an_imported_module_runs_a_real_interpreter(tmp_path):
    """A script's folder (or the cwd of -m and -c) first on sys.path: a module there named as one the server
    imported from elsewhere (yaml, through jsonargparse) is the one a fresh interpreter imports."""
    (tmp_path / "yaml.py").write_text("WHERE = 'beside the script'\n")
    (tmp_path / "tool.py").write_text("import yaml\nprint(getattr(yaml, 'WHERE', 'site-packages'))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([cli_server.python(), str(tmp_path / "tool.py")], cwd=tmp_path.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "beside the script\n"), done.stderr[-3000:]
    assert _log().read_text().splitlines()[-1].endswith(f"real interpreter ({tmp_path} shadows an import)")
