"""Every misspelled key of a `lit-lm` config, at once: one line each, with the nearest known key.

jsonargparse stops at the first unknown key and prints it inside ~50 lines of usage; a user fixing a yaml file
one typo per run learns nothing from the rest. This checks the yaml files (the default config and every
`--config`) and the dotted options (`--trainer.max_step 3`) against the keys the CLI knows before it parses
anything: the top level, `trainer.*` (Trainer's arguments), the model's and the data's init args (of their
`class_path`, lit-lm's by default), `model.init_args.config.*`, `.schedule.*` and `.lora.*` (ModelConfig's,
Schedule's and LoRA's fields) and `model.init_args.optimizer.*` (the named optimizer class's init args; a name that
is no optimizer class is refused too). Other values that are themselves objects (callbacks, loggers, a strategy
given as a class) are left to jsonargparse.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import yaml

from lit_lm.moved import load_yaml

TOP_LEVEL = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path",
             "weights_only", "config", "print_config", "verbose", "return_predictions")
SUBCLASS = ("class_path", "init_args", "dict_kwargs")  # what jsonargparse accepts beside a class's init args
DEFAULT_CLASSES = {"model": "lit_lm.module.LanguageModel", "data": "lit_lm.data.datamodule.TextDataModule"}
MODEL_DATACLASSES = {"config": "lit_lm.config.ModelConfig", "schedule": "lit_lm.schedules.Schedule",
                     "lora": "lit_lm.lora.LoRA"}
OPTIMIZER = ("model", "init_args", "optimizer")


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def optimizer_class(name: str) -> Optional[type]:
    """The optimizer class `name` means, as jsonargparse resolves it (an import path, or a torch.optim class's or
    an imported Optimizer subclass's bare name), or None."""
    import torch

    found = _import(name) if "." in name else getattr(torch.optim, name, None)
    if found is None and "." not in name:
        found = next((c for c in _subclasses(torch.optim.Optimizer) if c.__name__ == name), None)
    return found if isinstance(found, type) and issubclass(found, torch.optim.Optimizer) else None


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _init_args(class_path: str) -> Optional[list[str]]:
    """The keyword arguments of `class_path`'s __init__ (None when it cannot be imported or takes **kwargs)."""
    cls = _import(class_path) if "." in class_path else optimizer_class(class_path)
    if cls is None:
        return None
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params]


def _known(path: tuple[str, ...], class_paths: dict[str, str]) -> Optional[list[str]]:
    """The keys allowed under `path` (a tuple of keys from the top), or None when not checked."""
    from lightning.pytorch import Trainer

    if not path:
        return list(TOP_LEVEL)
    if path[:3] == OPTIMIZER and class_paths.get("optimizer"):
        args = _init_args(class_paths["optimizer"])
        if args is None or len(path) > 4 or path[3:] not in ((), ("init_args",)):
            return None
        return args if path[3:] else [*SUBCLASS, *args]  # jsonargparse also takes `optimizer.momentum`
    if path == ("trainer",):
        return _init_args(f"{Trainer.__module__}.{Trainer.__name__}")
    if path[0] in DEFAULT_CLASSES and len(path) <= 3:
        args = _init_args(class_paths.get(path[0], DEFAULT_CLASSES[path[0]]))
        if args is None:
            return None
        if len(path) == 1:
            return [*SUBCLASS, *args]
        if path[1:] == ("init_args",):
            return args
        if path[:2] == ("model", "init_args") and path[2:] and path[2] in MODEL_DATACLASSES and path[2] in args:
            return [f.name for f in dataclasses.fields(_import(MODEL_DATACLASSES[path[2]]))]
    return None


def _walk(tree: Any, path: tuple[str, ...], class_paths: dict[str, str]) -> Iterator[tuple[str, list[str]]]:
    """(dotted unknown key, the keys allowed there) for every unknown key of a yaml tree."""
    if not isinstance(tree, dict):
        return
    known = _known(path, class_paths)
    if known is None:
        return
    for key, value in tree.items():
        name = str(key).removesuffix("+")  # `callbacks+:` appends to a list
        if name not in known:
            yield ".".join((*path, name)), known
        else:
            yield from _walk(value, (*path, name), class_paths)


def _line(key: str, known: list[str], where: str, prefix: str = "") -> str:
    leaf = key.rpartition(".")[2]
    close = difflib.get_close_matches(leaf, known, n=1)
    parent = key.rpartition(".")[0]
    fix = f"did you mean {prefix}{parent + '.' if parent else ''}{close[0]}?" if close else \
        "see `lit-lm <subcommand> --help` for the keys"
    return f"unknown key {leaf!r} in {where} ({key}); {fix}"


def _optimizer_named(trees: Sequence[Any], argv: Sequence[str]) -> Optional[str]:
    """The optimizer class the config names last (`model.init_args.optimizer`: the yaml files, then the command
    line), or None."""
    named = None
    for tree in trees:
        init_args = tree.get("model", {}).get("init_args") if isinstance(tree.get("model"), dict) else None
        if isinstance(init_args, dict) and "optimizer" in init_args:
            value = init_args["optimizer"]
            named = value.get("class_path") if isinstance(value, dict) else value
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in ("--" + ".".join(OPTIMIZER), "--" + ".".join(OPTIMIZER) + ".class_path"):
            named = value if eq else argv[i + 1] if i + 1 < len(argv) else None
    return named if isinstance(named, str) and named not in ("null", "None", "") and named[:1] != "{" else None


def unknown_keys(config_files: Sequence[str | Path], argv: Sequence[str]) -> list[str]:
    """One message per unknown key in `config_files` and in argv's dotted options, in the order given, after one for
    an optimizer that is no optimizer class."""
    trees = []
    for file in config_files:
        try:
            tree = load_yaml(Path(file).read_text())
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse reports a missing or malformed file itself
        if isinstance(tree, dict):
            trees.append((file, tree))
    optimizer = _optimizer_named([t for _, t in trees], argv)
    messages = []
    if optimizer is not None and optimizer_class(optimizer) is None:
        messages.append(f"{optimizer!r} is not an optimizer class (model.init_args.optimizer); name a "
                        "torch.optim.Optimizer subclass, e.g. torch.optim.SGD (docs/optim.md)")
        optimizer = None
    found = {"optimizer": optimizer} if optimizer else {}
    for file, tree in trees:
        class_paths = {k: tree[k]["class_path"] for k in DEFAULT_CLASSES
                       if isinstance(tree.get(k), dict) and isinstance(tree[k].get("class_path"), str)}
        messages += [_line(key, known, str(file)) for key, known in _walk(tree, (), {**class_paths, **found})]
    for arg in argv:
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            continue
        path = tuple(key.removesuffix("+") for key in arg[2:].split("=", 1)[0].split("."))  # `callbacks+.init_args.x`
        for depth in range(len(path)):
            known = _known(path[:depth], found)
            if known is None:
                break
            if path[depth] not in known:
                messages.append(_line(".".join(path[: depth + 1]), known, "the command line", "--"))
                break
    return messages


def config_files(argv: Sequence[str], defaults: Sequence[str | Path]) -> list[str | Path]:
    """The yaml files a LightningCLI command line reads: the defaults, then every `--config FILE`."""
    files: list[str | Path] = list(defaults)
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.removeprefix("--config="))
    return files
