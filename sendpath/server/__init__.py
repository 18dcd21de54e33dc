"""The replica server: one engine behind an OpenAI-compatible HTTP API."""
