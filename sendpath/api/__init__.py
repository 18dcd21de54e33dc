"""The OpenAI API's request bodies as both the gateway and the replica read them (torch-free)."""
