"""The HTTP server: OpenAI-compatible and native endpoints over an AsyncEngine."""

from radixserve.server.app import build_app, serve
from radixserve.server.async_engine import AsyncEngine
from radixserve.server.engine_api import EngineUnavailableError, QueueFullError

__all__ = ["AsyncEngine", "EngineUnavailableError", "QueueFullError", "build_app", "serve"]
