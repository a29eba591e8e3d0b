"""Murmur node. Its rooms, importing one way (each only from those before it):

- `node` itself: what every room shares (`config`, `store`, `home`, the worker `pipe`, the `status` views, `logs`);
- `node.core`: the sans-IO core and its sub-machines and events (no I/O, time passed in);
- `node.worker`: the worker process (torch: generate, train, publish) and what it plans with;
- `node.ui`: what a running node shows (dashboard, metrics);
- `node.shell`: the trio network process that owns the core (runtime, worker link, reachability, control socket);
- `node.cli`: the command line (node, tasks, bench, sim, demo, doctor).
"""

__version__ = "0.1.0"
