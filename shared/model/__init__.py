"""Llama-family decoder, its operator graph and segment split, weight loading, tokenizer, batching engine."""
