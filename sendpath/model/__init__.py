"""The model: Llama-family network, weight loading, tokenizer and sampler (torch lives here)."""
