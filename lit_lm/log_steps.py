"""When Lightning writes the step metrics: the one question the LightningModule and the callbacks that log ask alike."""

from __future__ import annotations

import lightning as L


def logs_this_batch(trainer: L.Trainer) -> bool:
    """Whether Lightning writes the step metrics at the end of this training batch: every `log_every_n_steps`
    optimizer steps, at the last micro-batch of an accumulation window. Metrics that need a host read (a
    device value made a float, a synchronised clock) are reduced on these batches only, so the steps in
    between run without one (tests/test_host_sync.py). Lightning's own `LearningRateMonitor` asks the same."""
    return trainer._logger_connector.should_update_logs and not trainer.fit_loop._should_accumulate()
