"""What the handlers share (ServerState): an ended app lets go of its engine."""

from __future__ import annotations

import gc
import weakref


async def test_an_ended_app_does_not_keep_its_engine_alive(serve_tiny):
    # aiohttp caches each app's middleware chain in a module-level LRU (1,024 entries) that outlives the app; an
    # app that still held its engine kept the model and the KV cache with it (about 190 MB a test on the tiny model).
    async with serve_tiny() as client:
        resp = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert resp.status == 200  # a request through the middleware puts the app in aiohttp's cache
        engine = weakref.ref(client.engine)
        handle = weakref.ref(client.state.engine)
        state = client.state
    del client
    gc.collect()
    assert state.engine is None and state.tokenizer is None
    assert handle() is None, "the engine handle outlived its app"
    assert engine() is None, "the engine outlived its app"
