"""The OpenAI-compatible gateway: routing, the upstream pool, API keys, metrics, the handler."""
