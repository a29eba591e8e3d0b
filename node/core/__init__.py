"""The node's sans-IO core: `machine.NodeCore` and its sub-machines (peer table, lineages, catch-up, sealing,
supervision), the events it takes and the actions it returns, and the rules it applies (roles, credit)."""
