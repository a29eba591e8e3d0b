"""What a running node shows its user: the terminal dashboard and the Prometheus metrics."""
