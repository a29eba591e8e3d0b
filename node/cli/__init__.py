"""The `murmur` command line: `app` (the entry point) and one module per command group, with the
launcher, the demo and the doctor."""
