"""Lightning's and torch's messages that say nothing true about a lit-lm run, silenced with the reason for each.

Every run printed them, on every rank, until a user stopped reading stderr (and missed what mattered there).
Each entry names the message and why it does not apply; anything not listed here is shown as before.
"""

from __future__ import annotations

import logging
import warnings

# (message regex, why it does not apply to a lit-lm run)
WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated",
     "Lightning 2.6's own use of a torch API deprecated in torch 2.10; nothing a user can change, once per rank"),
    (r"It is recommended to use `self\.log\('val_(loss|ppl)', \.\.\., sync_dist=True\)`",
     "val_loss and val_ppl come from a torchmetrics MeanMetric, which reduces itself over the ranks"),
    (r"Checkpoint directory .* exists and is not empty",
     "a run's checkpoints/ folder is shared by its first fit and every resume by design (`--ckpt_path last`)"),
)
# (start of an INFO message from Lightning's loggers, why it does not apply)
INFO = (
    ("💡 Tip: For seamless cloud", "an advertisement for a hosted logger, printed on every run"),
)


class _DropInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(start) for start, _ in INFO)


def silence_known_noise() -> None:
    """Install the filters (idempotent): warnings by message, Lightning's INFO lines at its loggers' handlers."""
    for pattern, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropInfo) for f in handler.filters):
                handler.addFilter(_DropInfo())
