"""kvstrata.serve: the OpenAI-compatible HTTP server over the engine core (``kvstrata serve``).

``build_app(llm, ServerConfig(...))`` is an ASGI app (Starlette); ``kvstrata serve`` runs it under
uvicorn. The engine runs in one thread of its own (:mod:`.worker`); handlers reach it through a
queue. See ``docs/serving.md``.
"""

from .app import ServerConfig, build_app

__all__ = ["ServerConfig", "build_app"]
