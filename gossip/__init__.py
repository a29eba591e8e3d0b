"""Gossip: libp2p host, wire messages, signing, validation pipeline, peer scoring, rollout pool."""
