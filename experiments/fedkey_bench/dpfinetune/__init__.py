"""`fedkey-bench dpfinetune`: private fine-tuning from the public base (issue 66)."""
