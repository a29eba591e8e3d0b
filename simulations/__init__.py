"""Murmur simulations package."""
