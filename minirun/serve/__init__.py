"""`minirun serve`: an OpenAI-compatible HTTP server over one Engine, with a chat page.

app.py (the endpoints), page.py (the chat page and /props), schemas.py (request bodies),
worker.py (the engine's thread and queue), server.py (uvicorn, signals). With --replicas, on Ray Serve (the `ray` extra): launch.py (start,
stop), replicas.py (the deployments: the same app over a RemoteWorker, and the engine replicas),
router.py (Ray's request router) over affinity.py (which replica holds a prompt's prefix).
"""
from .app import create_app
from .worker import EngineWorker, Job

__all__ = ["create_app", "EngineWorker", "Job"]
