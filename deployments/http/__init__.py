"""The HTTP side of the ingress: OpenAI error JSON, form parsing, windows in flight, SSE, response formats."""
