"""Sharded checkpoints: resume continues the exact run on 2 ranks and on 1, and the single-file converter; an MoE run
resumed under a lit-lm strategy from a one-process single file starts from its every parameter and buffer."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_lm.strategies.registry  # noqa: F401  (registers lm_ddp)
from dist_utils import TinyLM, fit_tiny, run_distributed
from test_cli import run_script
from lit_lm.checkpoints import find_last
from lit_lm.parity import MOE, Case, assert_parity, run_parity
from lit_lm.strategies.zero import ZeroStrategy
from lit_lm.strategies import safe_load
from lit_lm.strategies.checkpoint import check_complete, is_sharded_checkpoint, read_whole

K = 4  # optimizer steps per epoch: checkpoint at the end of epoch 0, train to 2K


def _train(devices: int, ckpt_dir: str | None, resume: str | None) -> dict:
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_last=True)
    callbacks = (saver,) if ckpt_dir else ()
    return fit_tiny("lm_ddp", devices=devices, steps_per_epoch=K, max_steps=2 * K, ckpt_path=resume,
                    callbacks=callbacks, one_batch=True)


def _assert_same_run(resumed: dict, full: dict) -> None:
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][K:]), rtol=1e-5, atol=0)
    for name, value in full["params"].items():
        assert ((resumed["params"][name] - value).norm() / value.norm()).item() < 1e-5, name


def _train_then_resume(ckpt_dir: str) -> tuple[dict, dict]:
    full = _train(2, ckpt_dir, None)
    return full, _train(2, None, str(Path(ckpt_dir) / f"epoch=0-step={K}.ckpt"))


def _resume_twice(*ckpt_paths: str) -> list[dict]:
    return [_train(1, None, path) for path in ckpt_paths]


def test_resume_on_2_and_1_ranks_and_from_a_converted_file(tmp_path: Path) -> None:
    full, resumed = run_distributed(_train_then_resume, 2, str(tmp_path), init_process_group=False)[0]
    assert len(full["losses"]) == 2 * K
    ckpt = tmp_path / f"epoch=0-step={K}.ckpt"
    assert is_sharded_checkpoint(ckpt) and is_sharded_checkpoint(tmp_path / "last.ckpt")  # last: saved twice
    _assert_same_run(resumed, full)

    # the converter, through its CLI: a plain Lightning checkpoint
    single = tmp_path / "single.ckpt"
    run_script("scripts/ckpt.py", "convert", ckpt, single, cwd=Path(__file__).parents[1], check=True)
    module = TinyLM.load_from_checkpoint(single)
    saved = safe_load.load(single)["state_dict"]
    assert module.hparams.lr == TinyLM().hparams.lr
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)

    # 1 rank under lm_ddp (DCP reshards; the global batch stays 8 = 1 x 8), from the directory and from the file
    for run in run_distributed(_resume_twice, 1, str(ckpt), str(single), init_process_group=False)[0]:
        _assert_same_run(run, full)
    # Lightning's own single-device strategy, from the file
    _assert_same_run(fit_tiny(devices=1, steps_per_epoch=K, max_steps=2 * K, ckpt_path=str(single), one_batch=True),
                     full)


# one step on one process (the aux-free balancing moves the router bias; a second one takes it back to 0 here),
# saved as one Lightning file, resumed under ZeRO-2 on 2 ranks for the harness's steps (test_parity_mutations.py
# breaks its buffer copy)
MOE_RESUME = Case(partial(ZeroStrategy, stage=2), model=MOE, resume=Case(model=MOE, steps=1),
                  label="zero2 MoE resumed from a one-process file")


def test_moe_resumed_from_a_single_file_restores_the_router_bias() -> None:
    """The MoE router bias (`expert_bias`, a persistent buffer the optimizer never sees) comes back from a one-process
    single-file checkpoint: the harness compares every parameter and buffer at the start, then the run continued."""
    (run,) = run_parity([MOE_RESUME], 2)
    assert_parity(run)
    bias = "model.blocks.1.mlp.router.expert_bias"
    assert run["single"]["start"][bias].abs().sum() > 0  # the saved bias moved from its zeros: the check can fail


# -- two callbacks saving at the same step: a hard-linked alias only of the same contents ------------------------
def _weights_only_then_full(ckpt_dir: str) -> dict:
    """6 steps with a weights-only save every 4 steps (listed first) and a full one every 2; then a fit resumed
    from the full step=4, and one from the weights-only step=4."""
    root = Path(ckpt_dir)
    savers = (ModelCheckpoint(dirpath=root / "weights", filename="{step}", every_n_train_steps=4, save_top_k=-1,
                              save_weights_only=True),
              ModelCheckpoint(dirpath=root / "full", filename="{step}", every_n_train_steps=2, save_top_k=-1))
    full = fit_tiny("lm_ddp", max_steps=6, callbacks=savers, one_batch=True)
    resumed = fit_tiny("lm_ddp", max_steps=6, ckpt_path=str(root / "full" / "step=4.ckpt"), one_batch=True)
    try:
        fit_tiny("lm_ddp", max_steps=6, ckpt_path=str(root / "weights" / "step=4.ckpt"), one_batch=True)
        refusal = "no error"
    except Exception as e:  # on main: Lightning's KeyError, a traceback
        refusal = f"{type(e).__name__}: {e}"
    return {"full": full, "resumed": resumed, "refusal": refusal}


def test_a_full_save_at_a_weights_only_saves_step_keeps_its_optimizer_state(tmp_path: Path) -> None:
    """The full callback's step=4 was a hard link to the weights-only save of the same step (its own meta.pt, the
    other's shards) and the resume restarted AdamW's moments from zero without a word: on main the resumed losses
    differ. Now it is its own save, and a fit from the weights-only file is refused in one line."""
    run = run_distributed(_weights_only_then_full, 1, str(tmp_path), init_process_group=False)[0]
    torch.testing.assert_close(torch.tensor(run["resumed"]["losses"]), torch.tensor(run["full"]["losses"][4:]),
                               rtol=1e-5, atol=0)
    saved = read_whole(tmp_path / "full" / "step=4.ckpt")["optimizer_states"]
    assert saved and all(s["exp_avg_sq"].abs().sum() > 0 for s in saved[0]["state"].values())
    assert check_complete(tmp_path / "weights" / "step=4.ckpt")["optimizers"] == 0  # what `--ckpt_path last` reads
    assert check_complete(tmp_path / "full" / "step=4.ckpt")["optimizers"] == 1
    refusal = run["refusal"]
    assert refusal.startswith(f"ConfigError: {tmp_path / 'weights' / 'step=4.ckpt'} holds no optimizer state"), refusal
    assert "\n" not in refusal


def test_last_for_a_fit_passes_over_a_newer_weights_only_save(tmp_path: Path) -> None:
    """`--ckpt_path last` of a fit takes the newest checkpoint with optimizer state (weights-only saves of a second
    callback in the same folder are newer); of validate/test, the newest of all."""
    full, weights_file, weights_dir = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "c.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": [{"state": {}, "param_groups": []}]}, full)
    torch.save({"state_dict": {}}, weights_file)
    weights_dir.mkdir()
    (weights_dir / "meta.pt").write_bytes(b"")
    (weights_dir / "COMPLETE").write_text(json.dumps({"step": 4, "optimizers": 0}))
    for age, file in enumerate((full, weights_file, weights_dir / "COMPLETE")):
        os.utime(file, (1000 + age, 1000 + age))
    assert find_last(tmp_path) == weights_dir
    assert find_last(tmp_path, resumable=True) == full
