"""OpenAI's wire types and their translation to and from engine requests, shared by the HTTP API
and the batch runner (no JAX, no engine imports)."""
