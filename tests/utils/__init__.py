"""Helpers shared by tests (checkpoints built with transformers)."""
