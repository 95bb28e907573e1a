"""Estimates before launch: per-rank memory, bytes and time of a layout (`estimate`), the ranking of every layout
of a cluster (`plan`), and the `lit-lm plan` command (`cli`)."""
