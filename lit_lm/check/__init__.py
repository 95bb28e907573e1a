"""`lit-lm check` (lit_lm/check/command.py): the user's own config under their strategy, against one process.

    build.py    the config files (fit's parser) -> the harness's cases (`CheckPlan`)
    scale.py    the scaled-down model that keeps every feature that decides the split
    meter.py    what each rank measures besides gradients (bytes per group, state bytes, seconds)
    compare.py  the harness's records -> per-parameter agreement, the first disagreement, its likely cause
    costs.py    communication and memory against the planner (lit_lm/planner/estimate.py), time per step
    report.py   the table, the verdict, JSON
"""
