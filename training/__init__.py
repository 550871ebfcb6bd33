"""Training pipeline: corpus, tokenizer, pretraining and export of the embedded target model."""
