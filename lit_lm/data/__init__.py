"""The data room: text in (`corpus`), tokenizers (`tokenizer/`), prepared shards (`prepare`, `token_file`), the
samplers and mixtures that read them (`sampler`, `mixture`, `stream`), and the LightningDataModule that serves the
windows (`datamodule.TextDataModule`)."""
