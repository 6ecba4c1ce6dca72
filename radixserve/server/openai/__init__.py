"""The OpenAI-compatible API: chat completions, completions, the field policy and the chat wire types."""
