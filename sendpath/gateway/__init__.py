"""The gateway: API keys, rate limits and quotas, safety, admission (torch-free)."""
