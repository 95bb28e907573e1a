"""Packed documents (`data.init_args.document_mask`, `position_reset`; lit_lm/data/packing.py): a row's documents are
read from its EOS tokens, attention never crosses them, RoPE positions optionally restart; the same under dp, ZeRO,
tp and pp (context parallelism: tests/test_cp_documents.py; the Triton kernels: tests/test_attention_varlen.py);
refused in one line where not built yet (position_reset under context parallelism)."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_stream import SEQ, make_dm, shards, take  # noqa: F401 (shards: the fixture)

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.data.packing import Packing, document_ids, document_positions
from lit_lm.data.token_file import DocumentPart, encode_documents
from lit_lm.data.tokenizer import load_tokenizer
from lit_lm.model import Transformer
from lit_lm.module import LanguageModel
from lit_lm.parity import TINY, Case, assert_parity, run_parity
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.pp import PipelineStrategy
from lit_lm.strategies.tp import TensorParallelStrategy
from lit_lm.strategies.zero import ZeroStrategy

EOS = 1


def test_documents_and_positions_come_from_the_eos_tokens():
    """A row that starts inside a document: its tail is document 0; an EOS ends its document (the next starts
    after it); consecutive EOS make one-token documents."""
    row = torch.tensor([[7, 7, EOS, 5, 6, 7, EOS, EOS, 4, 4],
                        [EOS, 3, 3, 3, 3, 3, 3, 3, 3, 3]])
    assert document_ids(row, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(document_ids(row, EOS)).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0, 1],
                                                                   [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert Packing(EOS).rows(row)[1] is None


def model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**dict(TINY, max_seq_len=32, **overrides)))


def packed_row(lengths: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Documents of `lengths` tokens, each ending in EOS, and their concatenation as one (1, T) row."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(2, TINY["vocab_size"], (n - 1,), generator=gen), torch.tensor([EOS])])
            for n in lengths]
    return torch.cat(docs)[None], docs


@pytest.mark.parametrize("window", [None, 3])
def test_each_document_of_a_packed_row_is_computed_as_if_alone(window):
    """With position_reset, a packed row's logits are, document by document, those of each document run alone
    (sliding window: within the document and the window), and so its per-token losses; one-token documents
    included. Fails with the mask dropped. (RoPE makes q_t . k_s depend on t - s only, so positions not reset
    change rounding only here: `test_per_row_positions_rotate_as_each_rows_own` catches that mutant.)"""
    m = model(sliding_window=window)
    row, docs = packed_row((5, 9, 3, 1, 6, 1, 7))
    documents, positions = Packing(EOS, position_reset=True).rows(row)
    with torch.no_grad():
        packed = m(row, positions, documents=documents)
        alone = torch.cat([m(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    targets = torch.randint(0, TINY["vocab_size"], row.shape)
    per_token = F.cross_entropy(packed[0], targets[0], reduction="none")
    starts = np.cumsum([0] + [len(d) for d in docs])
    for d, (a, b) in zip(docs, zip(starts[:-1], starts[1:])):
        torch.testing.assert_close(per_token[a:b], F.cross_entropy(m(d[None])[0], targets[0, a:b], reduction="none"),
                                   rtol=0, atol=1e-5)


def test_per_row_positions_rotate_as_each_rows_own():
    """RoPE with (B, T) positions (documents restarting at 0) gives each row exactly the rotation that row's own
    (T,) positions give."""
    rope = model().blocks["0"].attn.rope
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 6, 4, 8, generator=gen), torch.randn(2, 6, 2, 8, generator=gen)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 0, 1, 2]])
    got = rope(q, k, positions)
    for b in range(2):
        want = rope(q[b:b + 1], k[b:b + 1], positions[b].clone())
        assert torch.equal(got[0][b], want[0][0]) and torch.equal(got[1][b], want[1][0])


def test_without_position_reset_positions_run_on_through_the_row():
    """Mask only: each document is computed alone at its own place in the row (positions a..b-1)."""
    m = model()
    row, docs = packed_row((6, 4, 10))
    documents, positions = Packing(EOS).rows(row)
    assert positions is None
    with torch.no_grad():
        packed = m(row, documents=documents)
        starts = np.cumsum([0] + [len(d) for d in docs])
        alone = torch.cat([m(d[None], torch.arange(a, b)) for d, a, b in zip(docs, starts[:-1], starts[1:])], 1)
        assert not torch.allclose(packed, m(row), atol=1e-3)  # the mask changes something
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_a_single_document_row_is_todays_result():
    """No EOS in the row: one document, positions 0..T-1: the same as the model without documents."""
    m = model()
    row = torch.randint(2, TINY["vocab_size"], (2, 16))
    targets = torch.randint(0, TINY["vocab_size"], (2, 16))
    documents, positions = Packing(EOS, position_reset=True).rows(row)
    with torch.no_grad():
        torch.testing.assert_close(m.loss(row, targets, positions, documents), m.loss(row, targets))


def test_the_module_passes_the_rows_documents_and_off_is_untouched(monkeypatch):
    """LanguageModel.step_loss: without packing, model.loss(inputs, targets) exactly as before; with it, the rows'
    documents and reset positions."""
    module = LanguageModel(ModelConfig(**TINY))
    module.configure_model()
    calls = []
    monkeypatch.setattr(module.model, "loss", lambda *a, **k: calls.append((a, k)) or (torch.zeros(()),) * 2)
    row = torch.tensor([[3, EOS, 4, 5]])
    module.step_loss(row, row)
    module.packing = Packing(EOS, position_reset=True)
    module.step_loss(row, row)
    assert calls[0][1] == {} and len(calls[0][0]) == 2
    assert calls[1][1]["documents"].tolist() == [[0, 0, 1, 1]] and calls[1][1]["positions"].tolist() == [[0, 1, 0, 1]]


def test_position_reset_without_documents_is_refused_in_one_line():
    """(Under context parallelism it is built: tests/test_cp_documents.py.)"""
    with pytest.raises(ConfigError, match="position_reset"):
        from lit_lm.data.datamodule import TextDataModule
        TextDataModule(position_reset=True)


# -- the data: boundaries are the rows' own EOS tokens, wherever rows come from ------------------------------------
def document_ends(folder) -> np.ndarray:
    """Where each of the stream's documents ends (its last token's index + 1), from their lengths, not their EOS."""
    tok = load_tokenizer(folder.parent / "tok")
    parts = []
    for f in sorted(folder.iterdir()):
        lines = f.read_text().splitlines() if f.suffix == ".jsonl" else [None]
        parts += [DocumentPart([json.loads(s)["text"] if s else f.read_text()], True, True) for s in lines]
    return np.cumsum([len(next(encode_documents(tok, [part]))[0]) for part in parts])  # one document at a time


def test_boundaries_survive_the_stream_and_a_resume_under_another_world_size(shards):  # noqa: F811
    """A stream's rows carry their documents: 2 ranks read up to just before the first document's end, one rank
    resumes there; its rows' documents are the stream's true ones (from the documents' lengths), several per row."""
    ends = document_ends(shards)
    steps = int(ends[0]) // SEQ // 4 - 1  # global batches of 4 rows (2 ranks x 2) before the first boundary
    dm = make_dm(shards, 2, 0)
    take(dm, steps)
    resumed = make_dm(shards)
    resumed.load_state_dict(json.loads(json.dumps(dm.state_dict() | {"tokenizer": None})))
    rows = torch.cat(take(resumed, 12))
    documents = document_ids(rows[:, :-1], resumed.tokenizer.eos_id)
    for i, got in enumerate(documents):
        doc = np.searchsorted(ends, (4 * steps + i) * SEQ + np.arange(SEQ), side="right")
        assert got.tolist() == (doc - doc[0]).tolist(), i
    assert (documents.max(dim=1).values > 0).sum() >= 4


def test_boundaries_survive_a_mixture(tmp_path):
    """Two prepared sources of short documents mixed by weight: every mixed row's documents are its source's true
    ones at that window (from the documents' lengths); a row is a pure function of its global position, so a resume
    under any world size reads the same rows, hence the same documents (test_data_mixture)."""
    from lit_lm.data.mixture import MixtureWindows, ShardWindows
    from lit_lm.data.prepare import PreparedSource, prepare
    from lit_lm.data.tokenizer import BPETokenizer
    from test_data_mixture import words

    BPETokenizer.train([words(200, 99)], 280).save_hf(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    sources, ends = [], []
    for i in range(2):
        texts = [words(1 + j % 3, 100 * i + j) for j in range(60)]
        f = tmp_path / f"s{i}.jsonl"
        f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        prepare([str(f)], str(tmp_path / "tok"), str(tmp_path / f"p{i}"), chunk_mb=0.001, val_fraction=0.0,
                progress=False)
        source = PreparedSource(str(tmp_path / f"p{i}"))
        sources.append(ShardWindows(source.parts("train"), SEQ))
        starts = np.cumsum([0] + [int(s["tokens"]) for s in source.index["shards"]])  # each shard's first token
        ends.append((starts, np.cumsum([len(next(encode_documents(tok, [DocumentPart([t], True, True)]))[0])
                                        for t in texts])))
    mixture = MixtureWindows(sources, [0.6, 0.4], seed=3)
    boundaries = 0
    for p in range(60):
        s, w = mixture.locate(p)
        part = int(np.searchsorted(sources[s].ends, w, side="right"))
        first = ends[s][0][part] + (w - (int(sources[s].ends[part - 1]) if part else 0)) * SEQ
        doc = np.searchsorted(ends[s][1], first + np.arange(SEQ), side="right")
        got = document_ids(mixture[p][None, :-1], tok.eos_id)[0]
        assert got.tolist() == (doc - doc[0]).tolist(), p
        boundaries += int(got.max())
    assert boundaries >= 30 and len(sources[0].parts) > 1


def test_the_data_module_gives_the_packing(shards):  # noqa: F811
    dm = make_dm(shards)
    assert dm.packing() is None
    dm = make_dm(shards)
    dm.document_mask, dm.position_reset = True, True
    assert dm.packing() == Packing(dm.tokenizer.eos_id, True)


# -- under strategies that do not split the sequence: the documents travel with the rows -------------------------
PACKED = (EOS, True)
CASES = {
    "dp2": Case(partial(ComposedStrategy), packing=PACKED, label="dp2, packed documents"),
    "zero2": Case(partial(ZeroStrategy, stage=2), packing=PACKED, optimizer="adamw", label="zero2, packed documents"),
    "tp2": Case(partial(TensorParallelStrategy, tensor_parallel_size=2), packing=PACKED,
                model=dict(TINY, sliding_window=4), label="tp2 (sequence parallel), window 4, packed documents"),
    "pp2": Case(partial(PipelineStrategy, microbatches=2), packing=(EOS, False), label="pp2, packed, no reset"),
}


def test_packed_documents_match_one_process_under_dp_zero_tp_pp():
    for run in run_parity(list(CASES.values()), world_size=2):
        assert_parity(run)


def test_the_option_reaches_the_step_through_a_trainer(tmp_path):
    """`data.init_args.document_mask`/`position_reset`: the module takes the data module's packing at setup (the
    tokenizer's EOS), and the step's loss is the masked one."""
    import lightning as L

    from lit_lm.data.datamodule import TextDataModule

    files = []
    for i in range(30):
        files.append(str(tmp_path / f"doc{i}.txt"))
        (tmp_path / f"doc{i}.txt").write_text(" ".join(["alpha beta", "gamma (x)", "y: delta"][i % 3] for _ in
                                                       range(1 + i % 4)) + "\n")
    losses = {}
    for mask in (False, True):
        torch.manual_seed(0)
        data = TextDataModule(files=files, data_dir=str(tmp_path / "data"), vocab_size=270, seq_len=32,
                              batch_size=2, val_fraction=0.2, document_mask=mask, position_reset=mask)
        module = LanguageModel(ModelConfig(**dict(TINY, vocab_size=270, max_seq_len=32)))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0)
        trainer.fit(module, datamodule=data)
        losses[mask] = float(trainer.callback_metrics["train_loss"])
        assert module.packing == (Packing(data.tokenizer.eos_id, True) if mask else None)
    assert losses[True] != losses[False]
