"""HTTP: the Starlette app factory, native and OpenAI-compatible routes, and the launcher."""
