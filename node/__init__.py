"""Murmur node: CLI, config, identity, runtime, state store, dashboard, metrics, doctor."""

__version__ = "0.1.0"
