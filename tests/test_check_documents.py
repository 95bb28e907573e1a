"""`lit-lm check` proves a context-parallel layout with packed documents (issue 57): with `data.init_args.document_mask`
the check's rows are packed (documents of ~5 tokens crossing the cp chunks) and both the layout and one process mask
attention at them, so a rank that drops the mask fails the check."""

from __future__ import annotations

from test_check import _argv, _checked
from test_cp_documents import drop_mask_on_rank_1

DOCUMENTS = ("--data.init_args.document_mask", "true")
ULYSSES = ("--trainer.strategy.init_args.cp_method", "ulysses")


def test_a_cp_layout_with_documents_passes_and_a_dropped_mask_fails() -> None:
    """cp2 ring and cp2 Ulysses with documents pass (every gradient within 1e-5 of one process with the same mask);
    the mask dropped on cp rank 1 fails, at the first loss. Without the check packing the rows, neither side would
    mask and the mutant would pass."""
    argvs = [_argv("cp", 2, *DOCUMENTS), _argv("cp", 2, *DOCUMENTS, *ULYSSES), _argv("cp", 2, *DOCUMENTS)]
    ring, ulysses, dropped = _checked(argvs, steps=2, mutations=[None, None, drop_mask_on_rank_1],
                                      optimizers=[("sgd",)] * 3)
    for report in (ring, ulysses):
        assert report["ok"] and report["verdict"].startswith("PASS"), report["verdict"]
        assert any("document_mask: rows packed" in note for note in report["model"]["changes"])
    assert not dropped["ok"] and "loss" in dropped["verdict"], dropped["verdict"]
