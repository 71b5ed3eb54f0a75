"""minirun: a from-scratch Llama runtime with an HCAttention KV cache for million-token contexts."""
from .config import EngineConfig, ModelArgs, parse_ctx
from .errors import CheckpointError, ContextError, MiniRunError

__version__ = "0.1.0"


def __getattr__(name):
    # Engine pulls in torch; import it lazily so `minirun --help` and config tools stay quick
    if name in ("Engine", "GenerationResult"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["Engine", "GenerationResult", "EngineConfig", "ModelArgs", "parse_ctx",
           "MiniRunError", "CheckpointError", "ContextError"]
