"""Names that moved, and the one rewrite that keeps an old config working for a release.

lit-lm 0.2 installs one import root, `lit_lm` (before, `strategies`, `kernels` and `callbacks` were top-level
packages, whose names Hugging Face's `kernels` and two other published packages also use), and gives lit_lm's flat
modules rooms (`lit_lm.data`, `lit_lm.hf`, `lit_lm.planner`). A yaml, a command line or a saved run config that
names an old path (`class_path: strategies.composed.ComposedStrategy`) still runs until lit-lm 0.3: every config
lit-lm reads passes through `current_paths`, which rewrites the old path and warns once, in one line, naming the
new one. CHANGELOG.md lists the same moves for people; `tests/test_moved.py` holds the two to each other.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import get_loader, set_loader

UNTIL = "lit-lm 0.3"
PARSER_MODE = "lit_lm"  # jsonargparse's yaml, with old paths rewritten: `parser_mode()`
ROOT = Path(__file__).resolve().parent  # lit_lm/
# old module -> new module (a path under an old module moves with it)
MOVED = {
    "strategies": "lit_lm.strategies",
    "kernels": "lit_lm.kernels",
    "callbacks": "lit_lm.callbacks",
    "lit_lm.corpus": "lit_lm.data.corpus",
    "lit_lm.data": "lit_lm.data.datamodule",
    "lit_lm.mixture": "lit_lm.data.mixture",
    "lit_lm.prepare": "lit_lm.data.prepare",
    "lit_lm.sampler": "lit_lm.data.sampler",
    "lit_lm.stream": "lit_lm.data.stream",
    "lit_lm.token_file": "lit_lm.data.token_file",
    "lit_lm.tokenizer": "lit_lm.data.tokenizer",
    "lit_lm.hf_import": "lit_lm.hf.importer",
    "lit_lm.hf_export": "lit_lm.hf.exporter",
    "lit_lm.hf_families": "lit_lm.hf.families",
    "lit_lm.estimate": "lit_lm.planner.estimate",
    "lit_lm.plan": "lit_lm.planner.plan",
    "lit_lm.plan_cli": "lit_lm.planner.cli",
}
PACKAGES = tuple(old for old in MOVED if "." not in old)  # the old top-level packages: words of file names too
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")  # as Lightning's rank_zero_only reads
_warned: set[str] = set()


def current_path(path: str, source: str = "config") -> str:
    """`path` (a dotted module or object path) as it is named now; an old one warns once (rank 0) and is
    rewritten. Anything else is returned as given: `callbacks.yaml` is a file name (no module `yaml` under
    lit_lm.callbacks), `lit_lm.data.sampler` already a new path (lit_lm.data is a package now)."""
    if not DOTTED.fullmatch(path):
        return path
    for old in sorted(MOVED, key=len, reverse=True):
        if path != old and not path.startswith(old + "."):
            continue
        first = path[len(old) + 1:].partition(".")[0]
        if old in PACKAGES and not (first and _is_module(f"{MOVED[old]}.{first}")):
            return path
        if old == "lit_lm.data" and _is_module(f"lit_lm.data.{first}"):
            return path
        new = MOVED[old] + path[len(old):]
        _warn_once(path, new, source)
        return new
    return path


def current_paths(tree: Any, source: str = "config") -> Any:
    """A loaded config (dicts, lists, strings) with every old path rewritten by `current_path`."""
    if isinstance(tree, dict):
        return {k: current_paths(v, source) for k, v in tree.items()}
    if isinstance(tree, list):
        return [current_paths(v, source) for v in tree]
    return current_path(tree, source) if isinstance(tree, str) else tree


def load_yaml(text: str, source: str = "config") -> Any:
    """`yaml.safe_load` for lit-lm's configs: old paths rewritten (`current_paths`)."""
    return current_paths(yaml.safe_load(text), source)


def parser_mode() -> str:
    """The `parser_mode` of lit-lm's LightningCLI parsers: every config file and yaml value it loads (a `{class_path:
    ...}` on the command line too) is jsonargparse's yaml with old paths rewritten. Registered on first use."""
    yaml_loader = get_loader("yaml")
    set_loader(PARSER_MODE, lambda text: current_paths(yaml_loader(text)), exceptions=(yaml.YAMLError,))
    return PARSER_MODE


def current_argv(argv: list[str]) -> list[str]:
    """The command line with old paths rewritten: `--trainer.strategy strategies.zero.ZeroStrategy` and the
    `--key=value` form (values that are yaml, such as `{class_path: ...}`, are rewritten when parsed)."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        out.append(key + eq + current_path(value, "the command line") if eq and key.startswith("--")
                   else current_path(arg, "the command line"))
    return out


def _is_module(dotted: str) -> bool:
    """Whether `dotted` (lit_lm.<...>) is a module or package of lit_lm's tree, read from the files (no import)."""
    *folders, name = dotted.split(".")[1:]
    folder = ROOT.joinpath(*folders)
    return bool(name) and ((folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file())


def _warn_once(old: str, new: str, source: str) -> None:
    rank = next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "0")
    if old in _warned or rank != "0":
        return
    _warned.add(old)
    # where it was read as the "file", with no source line to show: the warning prints as one line,
    # `<config>:0: FutureWarning: strategies.zero.ZeroStrategy is deprecated: use lit_lm.strategies.zero...`
    warnings.warn_explicit(f"{old} is deprecated: use {new} (the old path is read until {UNTIL}; CHANGELOG.md)",
                           FutureWarning, filename=f"<{source}>", lineno=0)
