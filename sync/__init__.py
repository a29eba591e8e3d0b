"""Murmur sync package."""
