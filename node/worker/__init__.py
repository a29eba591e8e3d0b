"""The worker process: torch generation, training and publishing (`main`), its start (`boot`), the bf16
policy it versions, its model plan and its view of the task sets."""
