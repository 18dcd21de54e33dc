"""The router: which replica answers a request (policies, pool, health); torch-free."""
