"""How a pipeline cuts the model's layers into stages: pure arithmetic, shared by the `pp` strategy and the
planner's estimates (`lit_lm.planner.estimate`), which must cut exactly as the strategy does."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

from lit_lm.strategies.errors import ConfigError


def split_layers(n_layers: int, stages: int, chunks: int = 1, layers_per_stage: Optional[Sequence[int]] = None,
                 costs: Optional[Sequence[float]] = None, first_extra: float = 0.0, last_extra: float = 0.0
                 ) -> list[list[int]]:
    """Contiguous layer ranges for the `stages * chunks` pipeline stages (stage s runs on rank s % stages).

    `layers_per_stage` fixes the sizes; otherwise the split minimises the most expensive stage, with `costs` per
    layer (default 1: balance by layers) and the embedding/head costs added to the first/last stage.
    """
    n_stages = stages * chunks
    if layers_per_stage is not None:
        sizes = list(layers_per_stage)
        if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes) < 1:
            raise ValueError(f"layers_per_stage={sizes} must give {n_stages} stages (pipeline_parallel_size "
                             f"{stages} x virtual_stages {chunks}) of at least 1 layer, summing to n_layers={n_layers}")
        bounds = list(itertools.accumulate(sizes, initial=0))
        return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]
    if n_stages > n_layers:
        what = "pipeline_parallel_size" if chunks == 1 else "pipeline_parallel_size x virtual_stages"
        raise ConfigError(f"{what} = {n_stages} stages but the model has {n_layers} layers: every stage needs at "
                         f"least one layer; lower {'virtual_stages' if chunks > 1 else 'pipeline_parallel_size'}")
    costs = list(costs) if costs is not None else [1.0] * n_layers
    prefix = list(itertools.accumulate(costs, initial=0.0))

    def load(s: int, i: int, j: int) -> float:  # stage s holding layers i..j-1
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)

    # best[s][j]: the smallest maximum load placing layers 0..j-1 on stages 0..s; ties go to the latest cut, so
    # a remainder layer lands on an early stage, not on the last one (which also runs the head and the loss)
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages)]
    for j in range(1, n_layers + 1):
        best[0][j] = load(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n_layers + 1):
            for i in range(s, j):
                cand = max(best[s - 1][i], load(s, i, j))
                if cand <= best[s][j] + 1e-12:
                    best[s][j], cut[s][j] = cand, i
    bounds = [n_layers]
    for s in range(n_stages - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds = [0, *reversed(bounds)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]
