"""Reading checkpoint files without running code from them: nothing from data runs as code.

A pickle can name any importable callable (`os.system`) and call it while it is read. Every file of a checkpoint is
therefore read with an allow-list of what may be constructed:

    load(path)                    torch.load(weights_only=True): tensors, plain containers and numbers, plus
                                  `SAFE_GLOBALS` (what lit-lm and Lightning write is plain: none needed today)
    SafeFileSystemReader(path)    DCP's reader, whose `.metadata` torch reads with plain `pickle.load`: here only
                                  DCP's own metadata classes (`DCP_METADATA_GLOBALS`) may appear in it
    SafeLoadPlanner / SafeEmptyLoadPlanner   DCP's planners, whose non-tensor values (`torch.save`d bytes: lr,
                                  betas...) torch reads with `weights_only=False`: here checked by `load` first

Anything else is refused with `UnsafeCheckpointError`, one line naming the file and the global it asked for
(`refusals_unwrapped` takes it out of DCP's CheckpointException).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from contextlib import contextmanager
from typing import IO, Any, Iterator, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lit_lm.strategies.errors import ConfigError

Source = Union[str, Path, IO[bytes]]

# Types beyond torch's weights_only defaults that lit-lm's checkpoints may hold (add one here, never turn the
# check off). Lightning's checkpoint dict, lit-lm's hyper-parameters (plain by design: lit_lm/module.py), the data
# module's settings (paths saved as str: lit_lm/cli.py) and the callbacks' states are plain types and tensors.
SAFE_GLOBALS: list[Any] = []

# (module, name) that DCP's `.metadata` pickle holds (torch 2.5-2.13): its dataclasses, torch.Size, dtypes, the
# memory-format enum, the layout helper and the checkpoint id (a Path)
DCP_METADATA_GLOBALS = frozenset({
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint._extension", "StreamTransformExtension"),
})


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file whose pickle names a callable or type outside the allow-list: refused, never run."""


def _refusal(source: Source, what: str) -> UnsafeCheckpointError:
    name = source if isinstance(source, (str, Path)) else getattr(source, "name", "a checkpoint stream")
    return UnsafeCheckpointError(
        f"{name} is refused: its pickle asks for {what}, which could run code when loaded; lit-lm reads checkpoints "
        "with torch.load(weights_only=True) (tensors and plain values only). Load it only if you trust its author "
        "(torch.load(..., weights_only=False)) and save its state again as plain values")


def _unsupported_global(error: Exception) -> str:
    """The global torch's weights_only unpickler refused, from its message ('... unsupported GLOBAL posix.system
    whose module posix is blocked', 'Unsupported global: GLOBAL x.Y was not an allowed global ...'), else the
    message's last informative line."""
    text = str(error)
    named = re.search(r"GLOBAL (\S+)", text)
    if named:
        return named.group(1)
    lines = [line.strip() for line in text.splitlines() if line.strip() and "weights_only" not in line]
    return (lines[0] if lines else type(error).__name__)[:160]


def load(source: Source, **kwargs: Any) -> Any:
    """`torch.load(source, weights_only=True, map_location="cpu", **kwargs)` with `SAFE_GLOBALS` allowed; a pickle
    asking for anything else raises `UnsafeCheckpointError` (before any of it runs)."""
    kwargs.setdefault("map_location", "cpu")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported" in str(e):
            raise _refusal(source, _unsupported_global(e)) from None
        raise


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in DCP_METADATA_GLOBALS and not (module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype)):
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` may hold only DCP's metadata classes (`DCP_METADATA_GLOBALS`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise _refusal(Path(str(path)), str(e)) from None
        if not isinstance(metadata, Metadata):
            raise _refusal(Path(str(path)), f"a {type(metadata).__name__} where DCP's Metadata belongs")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextmanager
def refusals_unwrapped() -> Iterator[None]:
    """Around a `dcp.load`: DCP wraps every rank's error in one CheckpointException; a refusal comes out as itself."""
    try:
        yield
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


class _SafeBytes:
    """DCP's planners read a non-tensor value with `torch.load(weights_only=False)`: read it safely first."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        load(io.BytesIO(value.getvalue()))  # raises for a value that is not plain
        value.seek(0)
        super().load_bytes(read_item, value)  # type: ignore[misc]


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """`dcp.load`'s default planner, non-tensor values read safely."""


class SafeEmptyLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """The planner that reads a whole checkpoint without a destination (one process), values read safely."""
