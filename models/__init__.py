"""The language model, tokenizers, checkpoint format and evaluation metrics."""
