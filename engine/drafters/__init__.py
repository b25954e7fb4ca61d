"""Drafters: propose draft tokens for speculative decoding (see :mod:`engine.drafters.base`)."""
