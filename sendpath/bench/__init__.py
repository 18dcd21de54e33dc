"""Load generation and measurement against any OpenAI-compatible server (torch-free)."""
