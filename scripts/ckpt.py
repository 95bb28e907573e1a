"""Inspect or export a lit-lm checkpoint.

    python scripts/ckpt.py inspect runs/.../checkpoints/last.ckpt      # step, topology, optimizer, every tensor
    python scripts/ckpt.py convert runs/.../checkpoints/last.ckpt model.ckpt   # one plain torch.save file
    python scripts/ckpt.py export-hf runs/.../checkpoints/last.ckpt hf/        # a Hugging Face model (docs/hf.md)
    python scripts/ckpt.py export-hf --merge-lora last.ckpt hf/   # a LoRA run: adapters merged (docs/finetune.md)
    python scripts/ckpt.py export-hf --dtype float32 last.ckpt hf/   # fp32 tensors (default: the family's dtype)

Every command takes any checkpoint a run writes: a single file (`make train`, Lightning's strategies) or a
sharded directory (lit-lm's strategies), and a Hugging Face model folder (config.json + safetensors). `inspect`
reads no tensor data: a directory's DCP metadata, marker and meta.pt, a file memory-mapped, or the safetensors
headers, so it is instant on any size; `convert` writes the whole state as one plain torch.save file
(`lit_lm.strategies.checkpoint.to_single_file` for a directory) and needs it in CPU memory; `export-hf`
is `lit_lm.hf.exporter.export_hf`; of a LoRA run (`model.init_args.lora`) it writes the adapter alone in PEFT's
folder format, or with `--merge-lora` the merged model (`lit_lm.hf.peft`). Errors are one line (`lit-lm: error:
...`, exit 2; `--debug` for a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lit_lm.checkpoints import read_checkpoint, read_meta  # noqa: E402
from lit_lm.errors import pop_debug_flag, reporting_errors  # noqa: E402
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.hf.exporter import EXPORT_DTYPES, export_hf  # noqa: E402
from lit_lm.hf.importer import HFWeights, is_hf_folder  # noqa: E402
from lit_lm.hf.peft import checkpoint_lora, export_lora  # noqa: E402
from lit_lm.strategies.checkpoint import check_complete, is_sharded_checkpoint, to_single_file  # noqa: E402
from lit_lm.strategies.safe_load import SafeFileSystemReader  # noqa: E402


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.dtype, list[int]]]:
    """(dotted name, dtype, shape) of every tensor in a checkpoint dict, as DCP's metadata names them."""
    if isinstance(value, torch.Tensor):
        yield prefix, value.dtype, list(value.shape)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{i}" if prefix else str(i))


HF_SHAPE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "qkv_bias",
            "rope_theta", "rope_scaling", "sliding_window")  # what `inspect` shows of a Hugging Face folder's config


def inspect(path: Path) -> None:
    meta = read_meta(path)  # raises one line for a path that is not a checkpoint
    if is_hf_folder(path):
        config = ModelConfig(**meta["hyper_parameters"]["config"])
        shape = {k: v for k, v in meta["hyper_parameters"]["config"].items()
                 if k in HF_SHAPE and v not in (None, False)}
        print(f"{path}\n  a Hugging Face model folder: {config.num_params() / 1e6:.2f}M parameters as lit-lm's "
              f"{json.dumps(shape)}")
        tensors = [(k, getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(d, "float32")), s)
                   for k, d, s in HFWeights(path, config).tensor_info()]
        files = sorted(path.glob("*.safetensors"))
    elif is_sharded_checkpoint(path):
        print(f"{path}\n  marker: {json.dumps(check_complete(path))}")
        tensors = [(k, v.properties.dtype, list(v.size)) for k, v in
                   SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
                   if isinstance(v, TensorStorageMetadata)]
        files = sorted(p for p in path.iterdir() if p.is_file())
    else:
        print(f"{path}\n  a single file")
        tensors, files = list(_tensors(meta)), [path]
    print(f"  epoch {meta.get('epoch')}, global_step {meta.get('global_step')}, "
          f"lightning {meta.get('pytorch-lightning_version')}")
    optimizer = _optimizer(meta.get("hyper_parameters") or {}, [name for name, _, _ in tensors])
    if optimizer:
        print(f"  {optimizer}")
    total = 0
    for name, dtype, size in sorted(tensors):
        nbytes = math.prod(size) * dtype.itemsize
        total += nbytes
        print(f"  {name:<70} {str(dtype).removeprefix('torch.'):<9} {size}  {nbytes:,} B")
    print(f"  {len(tensors)} tensors, {total:,} bytes of tensor data in {len(files)} files "
          f"({sum(p.stat().st_size for p in files):,} bytes on disk)")


def _optimizer(hparams: dict[str, Any], names: list[str]) -> str:
    """The optimizer a run named (`model.init_args.optimizer`; a LanguageModel's None: the default AdamW) and how
    many tensors hold each of its state keys (a sharded directory's `optimizer_0.state.<fqn>.<key>`, a file's
    `optimizer_states.0.state.<i>.<key>`): Muon's `momentum_buffer` per matrix, AdamW's `exp_avg`, ... per other."""
    keys = Counter(name.rsplit(".", 1)[1] for name in names
                   if re.match(r"(optimizer_\d+|optimizer_states\.\d+)\.state\.", name))
    named = hparams.get("optimizer")
    if named:
        what = f"optimizer {named.get('class_path')} {json.dumps(named.get('init_args', {}), default=str)}"
    elif "optimizer" in hparams:
        what = "optimizer torch.optim.AdamW (the default)"
    elif keys:
        what = "optimizer (not named in the hyper-parameters)"
    else:
        return ""
    counts = ", ".join(f"{key} x {n}" for key, n in sorted(keys.items()))
    return f"{what}; state: {counts or 'none (a weights-only checkpoint)'}"


def convert(path: Path, out_file: Path) -> None:
    """One plain torch.save file, loadable by `LightningModule.load_from_checkpoint`."""
    if is_sharded_checkpoint(path):
        to_single_file(path, out_file)
        return
    checkpoint = read_checkpoint(path)  # raises one line for a path that is not a checkpoint
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("inspect", help="step, topology, tensors and sizes").add_argument("checkpoint", type=Path)
    to_file = commands.add_parser("convert", help="one ordinary Lightning .ckpt file (torch.save)")
    to_file.add_argument("checkpoint", type=Path)
    to_file.add_argument("out_file", type=Path)
    export = commands.add_parser("export-hf", help="safetensors + config.json + tokenizer for transformers")
    export.add_argument("checkpoint", type=Path)
    export.add_argument("out_dir", type=Path)
    export.add_argument("--merge-lora", action="store_true",
                        help="a LoRA run: W + (alpha/r) B A into the base weights (default: the adapter alone, PEFT)")
    export.add_argument("--dtype", choices=list(EXPORT_DTYPES),
                        help="the tensors' dtype (default: the family's: bfloat16 for deepseek_v3 and gpt_oss, as "
                             "released; float32 for the others)")
    args = parser.parse_args()
    if args.command == "inspect":
        inspect(args.checkpoint)
    elif args.command == "convert":
        convert(args.checkpoint, args.out_file)
        print(f"wrote {args.out_file}")
    else:
        checkpoint = read_checkpoint(args.checkpoint)
        if args.merge_lora or checkpoint_lora(checkpoint) is not None:
            print(f"wrote {args.out_dir}: {export_lora(checkpoint, args.out_dir, args.merge_lora)}")
            return
        export_hf(checkpoint, args.out_dir, args.dtype)
        print(f"wrote {args.out_dir} (load with transformers.AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    with reporting_errors(pop_debug_flag(None)[1]):
        main()
