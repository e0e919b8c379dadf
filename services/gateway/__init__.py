"""The OpenAI-compatible HTTP gateway: auth, validation, admission, tokenization, SSE streaming."""
