"""Murmur training package."""
