"""What `pip install` gets: the wheel's one import root, and requirements/lock.txt as the exact environment.

The wheel is built from a copy of the source tree (setuptools writes build/ and *.egg-info beside the sources) with
this environment's setuptools (--no-build-isolation --no-index: no network). The lock is checked twice: as a file
(exact pins that meet pyproject.toml's ranges) and against this environment (every distribution lit-lm needs, walked
through the installed metadata, is pinned at the installed version). `make test-latest` runs the suite on purpose on
versions other than the lock's and sets LIT_LM_TEST_UNLOCKED=1, which skips only that second check.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
# not sources: the repo's own folders that are no part of a build (top level only: lit_lm/data is a package)
NOT_SOURCES = {"build", "dist", "runs", "data", "lightning_logs", "bench_results"}
# the move is real: one module from each room that used to be a top-level package
MOVED = ["lit_lm/strategies/composed.py", "lit_lm/kernels/rmsnorm.py", "lit_lm/callbacks/clip.py"]


def _ignore(folder, names):
    top = Path(folder) == ROOT
    return {n for n in names if n in ("__pycache__", ".git") or n.endswith((".pyc", ".egg-info"))
            or (top and (n.startswith(".") or n in NOT_SOURCES))}


def test_the_wheel_holds_one_import_root_lit_lm(tmp_path):
    src, out = tmp_path / "src", tmp_path / "wheel"
    shutil.copytree(ROOT, src, ignore=_ignore)
    repo_before = {p.name for p in ROOT.iterdir()}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True, timeout=300)
    # nothing written beside the sources of the repo itself
    assert not {"build", "dist"} & ({p.name for p in ROOT.iterdir()} - repo_before)
    (wheel,) = out.glob("lit_lm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        record = zf.read(f"{info}/RECORD").decode().splitlines()
        top_level = zf.read(f"{info}/top_level.txt").decode().split()
    for room in ("strategies/", "kernels/", "callbacks/"):
        assert not [line for line in record if line.startswith(room)], f"RECORD installs {room} at the top"
    assert top_level == ["lit_lm"], f"top_level.txt: {top_level}"
    tops = {n.split("/")[0] for n in names} - {info}
    assert tops == {"lit_lm"}, f"the wheel installs more than lit_lm at the top of site-packages: {sorted(tops)}"
    for path in MOVED:
        assert path in names, f"{path} is not in the wheel"


def _lock():
    """{canonical name: version} of requirements/lock.txt, each line checked to be an exact public pin."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = PIN.fullmatch(line.strip())
        assert m, f"lock.txt: {line!r} is not name==version"
        name, version = canonicalize_name(m[1]), Version(m[2])
        assert version.local is None, f"lock.txt: {line!r} carries a local label (write {version.public})"
        assert name not in pins, f"lock.txt pins {name} twice"
        pins[name] = version
    return pins


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_lock_pins_every_requirement_of_pyproject_within_its_range():
    pins, project = _lock(), _pyproject()
    header = [line for line in LOCK.read_text().splitlines() if line.startswith("#")]
    assert any("make lock" in line for line in header), "the header names the command that writes the lock"
    for name in ("pip", "setuptools", "wheel", "torch"):
        assert name in pins, f"lock.txt does not pin {name}"
    reqs = [*project["project"]["dependencies"], *project["project"]["optional-dependencies"]["dev"],
            *project["build-system"]["requires"]]
    for req in map(Requirement, reqs):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"pyproject.toml requires {req}, which lock.txt does not pin"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock.txt's {name}=={pins[name]} is not {req}"


def _installed():
    """{canonical name: Distribution} of this environment (the first on sys.path wins, as for an import)."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name is not None:
            found.setdefault(canonicalize_name(name), dist)
    return found


def _torch_pins(installed):
    """What torch itself pins with `==` (a CUDA build's triton and nvidia-*): `make install` takes those from the
    index torch came from, not from the lock. None on the CPU build."""
    if "torch" not in installed:
        return set()
    reqs = map(Requirement, installed["torch"].requires or [])
    return {canonicalize_name(r.name) for r in reqs if any(s.operator == "==" for s in r.specifier)}


@pytest.mark.skipif(os.environ.get("LIT_LM_TEST_UNLOCKED") == "1", reason="make test-latest: not the locked versions")
def test_this_environment_is_the_lock():
    pins, installed, project = _lock(), _installed(), _pyproject()
    torch_own = _torch_pins(installed)
    # every distribution installed that the lock names is at the lock's version (torch: any build of it)
    wrong = [f"{name} {dist.version} (lock: {pins[name]})" for name, dist in installed.items()
             if name in pins and name not in torch_own and Version(Version(dist.version).public) != pins[name]]
    assert not wrong, f"installed at other versions than lock.txt's: {wrong}; run `make install` (or `make lock`)"
    # and everything lit-lm needs here, walked from pyproject.toml through the installed metadata, is in the lock
    todo = [(req, None) for req in map(Requirement, [*project["project"]["dependencies"],
                                                     *project["project"]["optional-dependencies"]["dev"]])
            if req.marker is None or req.marker.evaluate({"extra": ""})]
    seen, missing = set(), []
    while todo:
        req, parent = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen or (parent == "torch" and name in torch_own):
            continue
        seen.add((name, frozenset(req.extras)))
        if name not in pins:
            missing.append(f"{name} (for {parent or 'pyproject.toml'})")
        assert name in installed, f"{name}, needed by {parent or 'pyproject.toml'}, is not installed"
        for sub in map(Requirement, installed[name].requires or []):
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in [*req.extras, ""]):
                todo.append((sub, name))
    assert not missing, f"needed but not pinned in lock.txt: {sorted(missing)}; run `make lock`"
