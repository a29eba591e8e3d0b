"""The trio network process that owns the core: one loop feeds it events and carries out its actions
(`runtime`), the worker link, patches and task sets over the network, reachability, the control socket,
and the meters of the loop itself."""
