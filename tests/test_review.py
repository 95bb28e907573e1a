"""Issue 37's review findings, each a test that fails on the defect it names (checked by putting the defect back):

1. `lit-lm check` prints its verdict and exits 2 when a rank fails with a gloo error (a bracketed source path rich
   read as markup), and runs the only plan's world once;
2. the check's tokens cover the scaled vocabulary (a tp rank's second vocabulary shard looked up and a target) and
   its model takes the tokenizer's vocabulary, as `fit` links it;
3. `predict` never emits an id past the tokenizer's last one;
4. scripts/offline.py `batches` clamps to what the split holds (one line), refuses a split below one batch;
5. import and tokenizer lines: the default rms_norm_eps, Qwen2's sliding-window refusal, a tokenizer's vocabulary
   with gaps, the two-token BOS prefix, the check's sliding-window scaling;
6. NCCL-only branches: `comm.p2p_batch`'s one work per batch; `grouped_linear`'s token groups aligned;
7. the deprecated aliases of the engine API that moved.
Each test runs in a second or less: no spawned world (the check's harness is replaced where a world would run).
"""

from __future__ import annotations

import io
import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from tokenizers import Tokenizer, models, processors

from lit_lm.check import command
from lit_lm.check.build import parse, plan_check
from lit_lm.check.report import render
from lit_lm.check.scale import scaled_config
from lit_lm.cli import DEFAULT_CONFIG, LitLMCLI
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.hf.importer import model_config
from lit_lm import moe
from lit_lm.moe import GROUP_ROWS, grouped_linear
from lit_lm.module import LanguageModel
from lit_lm.parity import TINY, case_tokens
from lit_lm.spawn import free_port
from lit_lm.data.tokenizer.hf import HFTokenizer
from lit_lm.strategies import comm
from lit_lm.strategies.layout import ParallelConfig

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
DEFAULTS = [str(DEFAULT_CONFIG)]
GLOO_ERROR = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
              "1800000ms for recv operation to complete")


def _argv(preset: str, devices: int, *extra: str) -> list[str]:
    return ["--config", str(CONFIGS / "strategies" / f"{preset}.yaml"), "--trainer.devices", str(devices), *extra]


# -- 1. the check's verdict on a rank failure -------------------------------------------------------------------
def test_a_rank_failure_is_the_verdict_exit_2_after_one_world(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    worlds = []

    def failing_world(cases: list, world: int, env: Optional[dict] = None) -> list:
        worlds.append(world)
        raise RuntimeError(f"process 1 terminated with the following error:\nTraceback ...\n{GLOO_ERROR}")

    monkeypatch.setattr(command, "run_parity", failing_world)
    with pytest.raises(SystemExit) as exit_:
        command.main(["--steps", "1", *_argv("ddp", 2)], LitLMCLI, DEFAULTS)
    assert exit_.value.code == 2
    out = capsys.readouterr().out
    assert worlds == [2]  # one world: the only plan's error is its own (a timeout is not waited for twice)
    assert "FAIL: the run does not start under" in out and "unbound_buffer.cc:78] Timed out" in out, out
    assert "[/pytorch/third_party/gloo" in out  # the brackets shown, not read as markup


def test_every_text_in_the_report_is_shown_as_it_is() -> None:
    """Names, notes, labels, messages, groups and the verdict may hold brackets: none is read as rich markup."""
    odd = "[bold]x[/] [/pytorch/a.cc:1] [red]"
    row = {"name": odd, "shape": [2], "ratio": 1.0, "error": 1.0, "step": 0, "final": None, "problem": odd}
    good = {**row, "name": f"{odd} good", "step": None, "error": 0.0, "problem": ""}
    report = {"ok": False, "strategy": odd, "world": 2, "layout": odd, "verdict": f"FAIL: {odd}", "tolerance": 1e-5,
              "model": {"checked_params": 10, "params": 10, "changes": [odd]},
              "runs": [{"label": odd, "params": [row, good], "losses": [0.0], "norms": [0.0], "ok": False,
                        "message": odd}],
              "costs": {"comm": [{"group": odd, "op": odd, "measured": 1, "estimate": 1, "agree": True}],
                        "estimate_error": odd,
                        "full_model": {"peak_bytes": 1, "model_state_bytes": 1, "activation_bytes": 1,
                                       "wire_bytes": {odd: 1}}}}
    text = io.StringIO()
    render(report, Console(file=text, width=400, highlight=False))
    out = text.getvalue()
    assert out.count(odd) >= 11 and f"{odd} good" in out, out  # strategy, layout, note, table title, names, ...


# -- 2. the check's tokens and vocabulary -----------------------------------------------------------------------
def _word_level(folder: Path, vocab: dict[str, int], config: dict | None = None,
                post: processors.TemplateProcessing | None = None) -> Path:
    """A `tokenizers` word-level tokenizer.json (+ tokenizer_config.json) with exactly these ids."""
    tok = Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    if post is not None:
        tok.post_processor = post
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_check_reads_every_vocabulary_row_of_the_tokenizers_vocabulary(tmp_path: Path) -> None:
    """With a 420-token tokenizer under tp 2 the check's model has 64 + 420 % 64 = 100 ids in 128 rows (as the
    user's 420 in 448): ids 64-99 live on the second rank's shard, and the data looks them up and predicts them."""
    eos = "<|endoftext|>"
    vocab = {**{f"w{i}": i for i in range(419)}, eos: 419}
    folder = _word_level(tmp_path / "tok", vocab, {"eos_token": eos, "add_bos_token": False})
    argv = _argv("tp", 2, "--data.init_args.tokenizer_dir", str(folder))
    plan = plan_check(parse(argv, LitLMCLI, DEFAULTS), argv, steps=2)
    assert plan.model.vocab_size == 420  # fit's linked vocabulary (the tokenizer's), not data.vocab_size (4096)
    small = plan.small
    assert small.vocab_size == 100 and small.padded_vocab_size == 128
    shard = small.padded_vocab_size // plan.dims["tp"]
    for case in plan.cases:
        tokens = case_tokens(case)
        assert int(tokens.max()) < small.vocab_size
        assert (tokens[:, :-1] >= shard).sum() > 10 and (tokens[:, 1:] >= shard).sum() > 10


# -- 3. predict ---------------------------------------------------------------------------------------------------
def test_predict_never_emits_an_id_past_the_tokenizers_last() -> None:
    torch.manual_seed(0)
    module = LanguageModel(ModelConfig(**TINY))
    module.configure_model()
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=40)))
    batch = torch.randint(0, 40, (8, 17))
    out = module.predict_step(batch, 0)
    assert out["completion"].shape == (8, 4)
    assert int(out["completion"].max()) < 40  # 24 of the 64 rows have no id: greedy picks them unrestricted


# -- 4. offline batches -------------------------------------------------------------------------------------------
def test_offline_batches_take_what_the_split_holds_in_one_line(capsys: pytest.CaptureFixture) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from offline import batches

    split = torch.arange(195 * 17).view(195, 17)  # 195 windows: 12 batches of 16
    got = batches(split, 16, 25, shuffle=False, flag="--val-batches")
    assert len(got) == 12 and all(b.shape == (16, 17) for b in got)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["[offline] --val-batches 25: the split holds 12 batches of 16 (195 windows): using 12"]
    assert len(batches(split, 16, 3)) == 3 and not capsys.readouterr().err  # fewer than held: as asked, silently
    with pytest.raises(ConfigError, match="holds 10 windows, fewer than one batch of 16"):
        batches(split[:10], 16, 2)


# -- 5. import and tokenizer lines ----------------------------------------------------------------------------
def _hf_folder(folder: Path, **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    # num_key_value_heads stated, as every released config does: transformers' default for it is the family's own
    # (32 for qwen2, 8 for mistral), which 4 heads cannot share
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4)
    (folder / "config.json").write_text(json.dumps({**shape, **config}))
    return folder


def test_a_config_without_rms_norm_eps_takes_the_hugging_face_default(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "llama", model_type="llama")
    assert ModelConfig().norm_eps != 1e-6  # lit-lm's own default differs: the import must not keep it
    assert model_config(folder).norm_eps == 1e-6
    assert model_config(_hf_folder(tmp_path / "set", model_type="llama", rms_norm_eps=1e-5)).norm_eps == 1e-5


@pytest.mark.parametrize("config", [{"use_sliding_window": True, "sliding_window": 8},
                                    {"layer_types": ["full_attention", "sliding_attention"]}],
                         ids=["use_sliding_window", "layer_types"])
def test_qwen2_with_a_sliding_window_is_refused_in_one_line(tmp_path: Path, config: dict) -> None:
    folder = _hf_folder(tmp_path / "qwen2", model_type="qwen2", **config)
    field = next(iter(config))  # the refusal names the key that asks for the window
    with pytest.raises(ConfigError, match=f"`{field}` .*cannot be imported: lit-lm windows every layer or none") as err:
        model_config(folder)
    assert "\n" not in str(err.value)


def test_qwen2_without_its_window_imports_unwindowed(tmp_path: Path) -> None:
    """Qwen2's configs state a `sliding_window` they do not use (use_sliding_window false): no window."""
    folder = _hf_folder(tmp_path / "qwen2", model_type="qwen2", use_sliding_window=False, sliding_window=32768,
                        layer_types=["full_attention"] * 2)
    cfg = model_config(folder)
    assert cfg.sliding_window is None and cfg.qkv_bias
    assert model_config(_hf_folder(tmp_path / "mistral", model_type="mistral", sliding_window=8)).sliding_window == 8


def test_a_tokenizer_with_id_gaps_has_one_more_than_its_largest_id(tmp_path: Path) -> None:
    vocab = {"a": 0, "b": 1, "</s>": 7, "c": 12}  # 4 tokens, largest id 12: an embedding needs 13 rows
    tok = HFTokenizer.load(_word_level(tmp_path / "gaps", vocab, {"eos_token": "</s>", "add_bos_token": False}))
    assert tok.vocab_size == 13 and tok.eos_id == 7
    assert tok.decode([0, 12]) == "a c"
    with pytest.raises(ValueError, match="token id 5 is not in this tokenizer"):
        tok.decode([5])


def test_a_post_processor_with_two_tokens_before_a_sequence_is_refused(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "<sys>": 2, "x": 3, "</s>": 4}
    one = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert HFTokenizer.load(_word_level(tmp_path / "one", vocab, post=one)).bos_id == 1
    two = processors.TemplateProcessing(single="<s> <sys> $A", special_tokens=[("<s>", 1), ("<sys>", 2)])
    with pytest.raises(ValueError, match=r"puts 2 tokens before a sequence \(\['<s>', '<sys>'\]\).*add_bos_token"):
        HFTokenizer.load(_word_level(tmp_path / "two", vocab, post=two))
    said = _word_level(tmp_path / "said", vocab, {"add_bos_token": True, "bos_token": "<s>"}, post=two)
    assert HFTokenizer.load(said).bos_id == 1  # tokenizer_config.json decides: the post-processor is not read


def test_the_checks_model_keeps_a_sliding_window_shorter_than_its_sequence() -> None:
    big = ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=4096, sliding_window=1024)
    small, notes = scaled_config(big, ParallelConfig(tp=2))
    assert 2 <= small.sliding_window < small.max_seq_len  # still a window within the check's sequence
    assert f"sliding_window 1024 -> {small.sliding_window}" in notes
    whole = ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=4096, sliding_window=4096)
    assert scaled_config(whole, None)[0].sliding_window == 4096  # a window over the whole sequence stays none
    tiny_window = ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=4096, sliding_window=3)
    assert scaled_config(tiny_window, None)[0].sliding_window == 3  # already shorter than the check's sequence


# -- 6. NCCL-only branches -----------------------------------------------------------------------------------
class _Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_p2p_batch_gives_every_op_a_handle_that_waits_for_it(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """NCCL fuses a batch into ONE work; gloo returns one per op. Either way every op gets a handle (the pipeline
    runner and the cp ring zip them with their ops) and waiting on it waits for its op."""
    posted = []

    def batch_isend_irecv(ops: list) -> list[_Work]:
        posted.append(ops)
        return [_Work()] if backend == "nccl" else [_Work() for _ in ops]

    monkeypatch.setattr(comm.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(comm.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(comm.dist, "P2POp", lambda op, tensor, peer, group: SimpleNamespace(op=op, peer=peer))
    ops = [comm.P2P("send", torch.ones(3), 1), comm.P2P("recv", torch.empty(3), 1), comm.P2P("send", torch.ones(2), 1)]
    handles = comm.p2p_batch(ops, label="test")
    assert len(posted) == 1 and [p.op for p in posted[0]] == [comm.dist.isend, comm.dist.irecv, comm.dist.isend]
    assert len(handles) == len(ops)
    for h in handles:
        assert h.wait()
    works = handles[0].works if backend == "nccl" else handles
    assert all(w.waits >= 1 for w in works)
    assert [r.op for r in list(comm.COMM_LOG.history)[-3:]] == ["send", "recv", "send"]


def _reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    ends = torch.tensor(counts).cumsum(0).tolist()
    return torch.cat([F.linear(x[e - c: e], w[i]) for i, (c, e) in enumerate(zip(counts, ends))])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 17, 0, 2], [16, 16, 0, 33]],
                         ids=["unaligned", "all empty", "empty first and last", "aligned and empty"])
def test_grouped_linear_aligns_every_group_and_matches_a_loop(monkeypatch: pytest.MonkeyPatch,
                                                              counts: list[int]) -> None:
    """Every group torch._grouped_mm sees starts on a multiple of GROUP_ROWS rows (the bf16 sm90 kernel's
    alignment), empty groups included; outputs and gradients equal a per-group F.linear (fp32: torch's
    fallback takes no float64); rows past the last group (a capacity's dropped ones) are the caller's to mask."""
    seen = []
    real = torch._grouped_mm

    def recording(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        seen.append((a.shape[0], offs.tolist()))
        return real(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    monkeypatch.setattr(moe, "ALIGNED_ON", ("cpu",))  # the CUDA path's alignment, run here
    gen = torch.Generator().manual_seed(0)
    kept = sum(counts)
    x = torch.randn(kept + 3, 12, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), 6, 12, generator=gen, requires_grad=True)
    y = grouped_linear(x, w, torch.tensor(counts).cumsum(0).to(torch.int32))
    assert y.shape == (kept + 3, 6)
    (rows, offs), = seen
    assert all(o % GROUP_ROWS == 0 for o in offs) and rows % GROUP_ROWS == 0 and rows >= offs[-1] + 3
    sizes = torch.diff(torch.tensor([0, *offs])).tolist()
    assert all(s == -(-c // GROUP_ROWS) * GROUP_ROWS for s, c in zip(sizes, counts))
    if not kept:
        return
    ref = _reference(x, w, counts)
    torch.testing.assert_close(y[:kept], ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(ref.shape, generator=gen)
    gx, gw = torch.autograd.grad((y[:kept] * g).sum(), (x, w))
    rx, rw = torch.autograd.grad((ref * g).sum(), (x, w))
    torch.testing.assert_close(gx[:kept], rx[:kept], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)


# -- 7. deprecated aliases -----------------------------------------------------------------------------------
def test_the_moved_engine_names_still_work_with_a_warning_naming_the_new_one() -> None:
    import lit_lm.strategies.ddp as ddp
    from lit_lm.strategies import grad_sync

    for name in ("GradSync", "broadcast_parameters", "flat_step"):
        with pytest.warns(DeprecationWarning,
                          match=f"lit_lm.strategies.ddp.{name} is deprecated.*lit_lm.strategies.grad_sync.{name}"):
            old = getattr(ddp, name)
        assert old is getattr(grad_sync, name) or issubclass(old, grad_sync.GradSync)
    with pytest.raises(AttributeError):
        ddp.NoSuchName  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from lit_lm.strategies.ddp import DataParallelStrategy  # noqa: F401 - the preset's class path: no warning


def test_the_documented_plain_loop_with_the_old_names_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`GradSync(model)`, backward, `finish()`, step: the old loop on a one-rank gloo group, warnings naming the new
    verbs, the gradient as one process's (one rank: the average is the gradient)."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.warns(DeprecationWarning):
            from lit_lm.strategies.ddp import GradSync
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        expected = torch.nn.Linear(4, 3)
        expected.load_state_dict(model.state_dict())
        x = torch.randn(5, 4)
        synced = GradSync(model)
        synced(x).square().sum().backward()
        with pytest.warns(DeprecationWarning, match=r"GradSync.finish\(\) is deprecated.*finish_grad_sync\(\)"):
            synced.finish()
        expected(x).square().sum().backward()
        torch.testing.assert_close(model.weight.grad, expected.weight.grad)
        with pytest.warns(DeprecationWarning, match=r"remove_hooks\(\) is deprecated.*detach\(\)"):
            synced.remove_hooks()
        assert not synced._hooks
    finally:
        dist.destroy_process_group()


# -- 8. suite speed: no process pool for a corpus of one task ---------------------------------------------------
def test_a_small_corpus_trains_its_tokenizer_without_a_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting spawned workers costs seconds of imports (every tiny `fit` of the suite paid it); one task of text
    is counted inline, with the same merges. Several tasks still go to the pool (tests/test_tokenizer.py)."""
    import multiprocessing

    from lit_lm.data.tokenizer.bpe import BPETokenizer

    text = "def main(argv):\n    return [a.upper() for a in argv]\n" * 40
    inline = BPETokenizer.train([text], vocab_size=300, num_workers=1)

    def no_pool(*args: object) -> None:
        raise AssertionError("a process pool for one task of text")

    monkeypatch.setattr(multiprocessing, "get_context", no_pool)
    assert BPETokenizer.train([text], vocab_size=300, num_workers=2).state_dict() == inline.state_dict()
