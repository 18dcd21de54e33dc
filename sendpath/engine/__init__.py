"""The engine: scheduling, output processing and the step loop (torch-free)."""
