"""The chat page at `/` and the read-only `/props` it reads (as llama-server's page and /props).

The page is three static files (static/: HTML, CSS, JavaScript; no build step, nothing fetched from
elsewhere) that talk to the server's own /v1/chat/completions. `/`, `/static/*` and `/props` need no
API key, as llama-server serves its page and /health to anyone: they show the model's name and
settings, never an answer; the page asks for the key when /v1 answers 401.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from ..config import hca_setting_name

STATIC = Path(__file__).parent / "static"

# no inline script or style, no other origin: the model's text cannot run code, and the page
# loads nothing from the network
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def cache_kind(config) -> dict:
    """{"kind": "dense"} or {"kind": "hca", "budget": "0.25" | "g64c16"} of an EngineConfig."""
    if config.kv != "hca":
        return {"kind": "dense"}
    if config.groups and config.centroids:
        return {"kind": "hca", "budget": f"g{config.groups}c{config.centroids}"}
    return {"kind": "hca", "budget": None if config.kv_budget is None else hca_setting_name(config.kv_budget)}


def props_of(engine, model_name: str, api_key_required: bool) -> dict:
    """What /props reports: the model, the context, the cache, whether /v1 needs a key."""
    return {"model": model_name, "n_ctx": engine.config.ctx, "cache": cache_kind(engine.config),
            "api_key_required": api_key_required}


def add_page(app: FastAPI, engine, model_name: str, api_key_required: bool) -> None:
    """Serve the page at `/`, its files under `/static`, and `/props`, on `app`."""
    props = props_of(engine, model_name, api_key_required)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    @app.get("/props")
    async def read_props():
        return props

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
