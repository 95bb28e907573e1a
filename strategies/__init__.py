"""HOW lit-lm parallelises: hand-written engines (importable without Lightning) and the Lightning strategy that
composes them (`strategies.composed`); `import strategies.registry` registers the strategy names."""
