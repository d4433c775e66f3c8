"""An OpenAI-style server that streams a fixed reply at once (for client ceilings and stream-count tests)."""
import socket

from aiohttp import web

CHUNK = b'data: {"choices":[{"index":0,"text":" x","finish_reason":null}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
END = b'data: {"choices":[{"index":0,"text":" y","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\ndata: [DONE]\n\n'

async def gen(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(CHUNK + END)
    return resp

async def models(request):
    return web.json_response({"data": [{"id": "m"}]})

def main():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    app = web.Application()
    app.router.add_post("/v1/completions", gen)
    app.router.add_get("/v1/models", models)
    sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0)); sock.listen(65535)
    print(sock.getsockname()[1], flush=True)
    web.run_app(app, sock=sock, print=None, backlog=65535, access_log=None)

if __name__ == "__main__":
    main()
