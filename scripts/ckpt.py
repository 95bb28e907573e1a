"""Inspect or export a lit-lm checkpoint.

    python scripts/ckpt.py inspect runs/.../checkpoints/last.ckpt      # step, topology, every tensor and its size
    python scripts/ckpt.py convert runs/.../checkpoints/last.ckpt model.ckpt   # one plain torch.save file
    python scripts/ckpt.py export-hf runs/.../checkpoints/last.ckpt hf/        # a Hugging Face Llama model

`inspect` reads only the DCP metadata, the marker and meta.pt (no tensor data), so it is instant on any size;
`convert` is `strategies.checkpoint.to_single_file` and needs the whole state in CPU memory; `export-hf` (any
checkpoint, file or directory) is `lit_lm.hf_export.export_hf`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lit_lm.checkpoints import read_checkpoint
from lit_lm.hf_export import export_hf
from strategies.checkpoint import META, check_complete, is_sharded_checkpoint, read_meta, to_single_file


def inspect(directory: Path) -> None:
    if not is_sharded_checkpoint(directory):
        raise SystemExit(f"{directory} is not a lit-lm sharded checkpoint (a directory with {META})")
    marker = check_complete(directory)
    print(f"{directory}\n  marker: {json.dumps(marker)}")
    meta = read_meta(directory)
    print(f"  epoch {meta.get('epoch')}, global_step {meta.get('global_step')}, "
          f"lightning {meta.get('pytorch-lightning_version')}")
    tensors = {k: v for k, v in dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    total = 0
    for name, md in sorted(tensors.items()):
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        total += nbytes
        print(f"  {name:<70} {str(md.properties.dtype).removeprefix('torch.'):<9} {list(md.size)}  {nbytes:,} B")
    files = sorted(p for p in directory.iterdir() if p.is_file())
    print(f"  {len(tensors)} tensors, {total:,} bytes of tensor data in {len(files)} files "
          f"({sum(p.stat().st_size for p in files):,} bytes on disk)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("inspect", help="step, topology, tensors and sizes").add_argument("directory", type=Path)
    convert = commands.add_parser("convert", help="one ordinary Lightning .ckpt file (torch.save)")
    convert.add_argument("directory", type=Path)
    convert.add_argument("out_file", type=Path)
    export = commands.add_parser("export-hf", help="safetensors + config.json + tokenizer for transformers")
    export.add_argument("checkpoint", type=Path)
    export.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    if args.command == "inspect":
        inspect(args.directory)
    elif args.command == "convert":
        to_single_file(args.directory, args.out_file)
        print(f"wrote {args.out_file}")
    else:
        export_hf(read_checkpoint(args.checkpoint), args.out_dir)
        print(f"wrote {args.out_dir} (load with transformers.AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
