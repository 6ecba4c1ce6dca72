"""The HTTP server: OpenAI-compatible, Anthropic and native endpoints over a ``ServingBackend``.

This module is the server's face: the packages above it (``scale/``, ``disagg/``, ``topology``,
``frontend``, ``cli``) import what they need from here, never from the modules inside
(``tests/test_structure.py`` checks it). The engine link they build on is ``radixserve.runtime``.
"""

from radixserve.runtime.async_engine import AsyncEngine
from radixserve.runtime.backend import EngineUnavailableError, QueueFullError
from radixserve.server.app import build_app, serve
from radixserve.server.http.protocol import GenerateSamplingParams
from radixserve.server.launch import (
    add_serve_arguments,
    api_keys_from_args,
    chat_template_from_args,
    engine_config_from_args,
    engine_from_args,
    run_from_args,
)

__all__ = [
    "AsyncEngine",
    "EngineUnavailableError",
    "GenerateSamplingParams",
    "QueueFullError",
    "add_serve_arguments",
    "api_keys_from_args",
    "build_app",
    "chat_template_from_args",
    "engine_config_from_args",
    "engine_from_args",
    "run_from_args",
    "serve",
]
