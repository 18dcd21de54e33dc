"""Runners: the only place (with model/) where tensors are built."""
