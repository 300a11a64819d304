"""A tiny streaming OpenAI-compatible /v1/completions server for the benchmark tests (no model): one SSE chunk per
token, then usage. Importable (``make_app``) or run as a process: ``python fake_openai_server.py --port N``."""

import argparse
import asyncio
import json

FAKE_MODEL = "fake-model.gguf"
EOS_AFTER = 2  # tokens the fake generates when the client does not ask it to ignore EOS


def make_app(bodies: list):
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        bodies.append(body)
        n = body["max_tokens"] if body.get("ignore_eos") else min(EOS_AFTER, body["max_tokens"])

        async def stream():
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                     "total_tokens": len(body["prompt"].split()) + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tag", default="")
    a = p.parse_args()
    print(f"started {a.tag}", flush=True)
    uvicorn.run(make_app([]), host="127.0.0.1", port=a.port, log_level="warning")
