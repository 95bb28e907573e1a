"""HOW lit-lm parallelises: hand-written engines (importable without Lightning) and the Lightning strategy that
composes them (`lit_lm.strategies.composed`); `import lit_lm.strategies.registry` registers the strategy names."""
