"""Hugging Face models in and out: the families lit-lm maps (`families`), reading a local HF folder's config and
safetensors into a `Transformer` (`importer`), and writing a checkpoint back as an HF folder (`exporter`)."""
