"""An embedding model behind the server: /v1/embeddings through the OpenAI SDK (float and base64) equal to
sentence-transformers' encode, its prompts, Matryoshka sizes, /v1/rerank and /score, and the text routes refused."""

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest

from helpers import sentence_model, start_server

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "python code: search, write, read!",
         " ".join(["the dog read a book in the city"] * 6)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("emb") / "gemma"
    st = sentence_model(path, "gemma")
    (path / "pagedllm_model.json").write_text(json.dumps({"matryoshka_dimensions": [48, 32, 16]}))
    proc, base, log = start_server(tmp_path_factory, "--model", str(path), "--served-model-name", "emb")
    yield st, base
    proc.terminate()
    proc.wait(30)


def _unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_openai_sdk_embeddings_equal_sentence_transformers(served):
    st, base = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in r.data])
    assert np.abs(got - st.encode(TEXTS)).max() <= 1e-5
    assert r.usage.prompt_tokens == sum(len(st.tokenizer(t)["input_ids"]) for t in TEXTS)
    # the SDK's default is base64 (decoded by the SDK into floats)
    b64 = client.embeddings.create(model="emb", input=TEXTS[0])
    assert np.abs(np.array(b64.data[0].embedding) - st.encode(TEXTS[0])).max() <= 1e-5
    q = httpx.post(base + "/v1/embeddings", json={"input": TEXTS, "prompt_name": "query"}).json()
    assert np.abs(np.array([d["embedding"] for d in q["data"]]) - st.encode(TEXTS, prompt_name="query")).max() <= 1e-5
    # Matryoshka: the first d dimensions, normalised again (sentence-transformers' truncate_dim + normalize)
    r = client.embeddings.create(model="emb", input=TEXTS, dimensions=16, encoding_format="float")
    want = st.encode(TEXTS, truncate_dim=16, normalize_embeddings=True)
    assert np.abs(np.array([d.embedding for d in r.data]) - want).max() <= 1e-5
    with pytest.raises(openai.BadRequestError, match="dimensions must be between 1 and 48"):
        client.embeddings.create(model="emb", input="x", dimensions=100)


def test_concurrent_requests_give_the_vectors_of_each_alone(served):
    st, base = served
    texts = [f"{t} {i}" for i in range(4) for t in TEXTS]

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(base + "/v1/embeddings", json={"input": t}) for t in texts))
        return np.array([r.json()["data"][0]["embedding"] for r in rs])

    assert np.abs(asyncio.run(go()) - st.encode(texts)).max() <= 1e-5


def test_rerank_and_score(served):
    st, base = served
    query, docs = "capital city of france", TEXTS
    want = _unit(st.encode(docs, prompt_name="document")) @ _unit(st.encode(query, prompt_name="query"))
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(base + path, json={"model": "emb", "query": query, "documents": docs, "top_n": 3})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == list(np.argsort(-want)[:3])
        assert np.allclose([x["relevance_score"] for x in res], np.sort(want)[::-1][:3], atol=1e-5)
        assert res[0]["document"]["text"] == docs[res[0]["index"]]
    r = httpx.post(base + "/v1/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                              "return_documents": False}).json()
    assert len(r["results"]) == 4 and "document" not in r["results"][0] and r["usage"]["total_tokens"] > 0
    s = httpx.post(base + "/score", json={"model": "emb", "text_1": query, "text_2": docs}).json()
    assert np.allclose([d["score"] for d in s["data"]], want, atol=1e-5) and s["data"][0]["object"] == "score"
    pairs = httpx.post(base + "/v1/score", json={"text_1": docs[:2], "text_2": docs[2:]}).json()["data"]
    wp = (_unit(st.encode(docs[:2], prompt_name="query")) * _unit(st.encode(docs[2:], prompt_name="document"))).sum(1)
    assert np.allclose([d["score"] for d in pairs], wp, atol=1e-5)
    bad = httpx.post(base + "/score", json={"text_1": docs[:2], "text_2": docs[:3]})
    assert bad.status_code == 400 and "give one text_1" in bad.json()["error"]["message"]


def test_errors(served):
    _, base = served
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})):
        r = httpx.post(base + path, json=body)
        assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"], (path, r.text)
    long = " ".join(["the cat sat on the mat"] * 20)
    r = httpx.post(base + "/v1/embeddings", json={"input": long})
    assert r.status_code == 400 and "maximum input length is 64" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
    r = httpx.post(base + "/v1/embeddings", json={"input": "x", "prompt_name": "nope"})
    assert r.status_code == 400 and "unknown prompt_name" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/rerank", json={"query": "x", "documents": [{"title": "no text"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    assert httpx.post(base + "/v1/rerank", json={"query": "x", "documents": []}).status_code == 400
    assert httpx.get(base + "/health").status_code == 200  # nothing above harmed the server
