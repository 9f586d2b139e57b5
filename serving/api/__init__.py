"""The HTTP API: JetStream and OpenAI routes, probes and metrics. It talks to the orchestrator only
(no JAX, model or engine imports), so it can be read, and tested for shape, on its own."""
