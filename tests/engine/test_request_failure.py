"""An engine failure inside one request fails that request (HTTP 500) while the others go on."""

import asyncio

import httpx
import pytest

from conftest import PROMPTS
from pagedllm import SamplingParams
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm_engine import build_config
from pagedllm.server.app import build_app
from helpers import model_of

POISON = 49150  # a valid token id that makes the (patched) model fail


@pytest.fixture(scope="module")
def app_and_engine():
    engine = AsyncLLM(build_config(dtype="float32"))
    model = model_of(engine)
    real_forward = model.forward

    def forward(input_ids, *a, **kw):
        if (input_ids == POISON).any():
            raise RuntimeError("injected kernel failure")
        return real_forward(input_ids, *a, **kw)

    model.forward = forward
    yield build_app(engine, ["m"]), engine
    engine.shutdown()


def test_failing_request_gets_500_others_continue(app_and_engine, llm):
    app, engine = app_and_engine
    expected = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            good = asyncio.ensure_future(c.post("/v1/completions", json={
                "prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0}))
            await asyncio.sleep(0.3)  # the good request is decoding when the bad one joins its batch
            bad = await c.post("/v1/completions", json={"prompt": [1, 2, POISON, 3], "max_tokens": 5})
            good = await good
            after = await c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
            return bad, good, after

    bad, good, after = asyncio.run(main())
    assert bad.status_code == 500
    assert "injected kernel failure" in bad.json()["error"]["message"]
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] == expected.outputs[0].text
    assert after.status_code == 200
    assert engine.is_alive
    kv = engine.engine.core.kv_cache_manager
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks
