"""`infertrace serve`: the bundled engine behind an OpenAI-compatible aiohttp server with profiler endpoints."""
