"""The HTTP gateway: OpenAI-compatible routes, validation, auth, SSE streams, /metrics, /health."""
