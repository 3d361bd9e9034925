"""trainserve: fine-tune BERT classifiers and serve the results (CLI and local-mode supervisor)."""

__version__ = "0.1.0"
