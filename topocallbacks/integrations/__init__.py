"""Adapters for training frameworks; each imports its framework, so import them only when it is installed."""
