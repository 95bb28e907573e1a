"""Convert a lit-lm sharded checkpoint directory into one ordinary Lightning .ckpt file.

    python scripts/convert_checkpoint.py runs/ckpt/epoch=0-step=100.ckpt model.ckpt

The file loads with `LightningModule.load_from_checkpoint` and resumes a single-device `Trainer.fit(ckpt_path=...)`.
Runs on one process; the whole model and optimizer state must fit in CPU memory.
"""

from __future__ import annotations

import argparse

from strategies.checkpoint import to_single_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a sharded checkpoint directory (it contains meta.pt)")
    parser.add_argument("out_file", help="the .ckpt file to write")
    args = parser.parse_args()
    to_single_file(args.directory, args.out_file)
    print(f"wrote {args.out_file}")


if __name__ == "__main__":
    main()
