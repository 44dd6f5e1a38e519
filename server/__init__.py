"""The OpenAI-compatible HTTP front (FastAPI), its errors and metrics, and the CLI."""
