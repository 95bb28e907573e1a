"""Imported once by each test worker's fork server (conftest.py adds it to `lit_lm.spawn.PRELOAD`): the modules
nearly every rank of the suite imports, so a forked rank finds them loaded instead of importing them again (about
a quarter of a second a rank, hundreds of ranks a run).

A module that fails to import here (an edit in progress) is skipped: the rank that needs it imports it itself and
fails there with its traceback, where a failure in the server would stop it and every later world of the worker.
"""

import contextlib
import importlib

for name in ("pytest", "dist_utils", "lit_lm.parity", "lit_lm.module", "lit_lm.strategies.composed",
             "lit_lm.strategies.registry"):
    with contextlib.suppress(Exception):
        importlib.import_module(name)
