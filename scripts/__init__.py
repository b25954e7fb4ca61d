"""Offline tooling for specmoe: corpus building, tiny-model training, benchmark data, measurements.

Run the entry points from the repository root, e.g. ``python scripts/train_tiny.py`` or
``python -m scripts.train_tiny``; both work.
"""
