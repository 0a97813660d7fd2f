"""The inference fleet: the token-in/token-out client, local vLLM servers, the worker extension, plans."""
