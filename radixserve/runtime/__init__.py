"""The engine's runtime: the link between the API server and the engine process (messages, the
client, streams, calls, supervision) and the engine process's own loop and roles."""
