"""POST /v1/completions and GET /v1/models through the real `openai` package against a real `latentlm serve`
(uvicorn) on a tiny store: choices equal /v1/sample's for the same seed and settings, logprobs equal /v1/score's
per-token log-probabilities (1e-6) and the top alternatives are the most probable tokens of the exact next-token
distribution, streaming, echo, stop, n, several prompts, and the error cases in the OpenAI error shape."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.service.conftest import Server

CHAINS = ("tiny", "blocked", "rank")  # hmm, blocked_hmm, rank_hmm
PREDICTIVE = ("tiny", "blocked")  # families that sample from the next-token distribution (top_p, temperature 0)
TOL = 1e-6


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    s = Server(store, tmp_path_factory.mktemp("completions"), {"LATENTLM_CALIBRATE": "0"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oa(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


def sample(server, model: str, **body) -> list[dict]:
    r = server.client.post("/v1/sample", json={"model": model, **body})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def score(server, model: str, seqs: list[list[int]]) -> list[list[float]]:
    r = server.client.post("/v1/score", json={"model": model, "input": seqs, "token_logprobs": True})
    assert r.status_code == 200, r.text
    return [d["token_logprobs"] for d in r.json()["data"]]


def vocab(server, model: str) -> list[str]:
    """The model's tokens by id, read back through the service (a token-id input decodes to its tokens)."""
    size = server.client.get(f"/v1/models/{model}").json()["vocab_size"]
    r = server.client.post("/v1/score", json={"model": model, "input": [list(range(size))], "token_logprobs": True})
    return r.json()["data"][0]["tokens"]


def completion_words(s: dict) -> list[str]:
    """A /v1/sample sample's tokens as a completion shows them: a final <eos> ends it and is not text."""
    return s["tokens"][:-1] if s["finish_reason"] == "eos" else s["tokens"]


def openai_error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_models_list_is_read_by_openai(oa):
    models = {m.id: m for m in oa.models.list()}
    assert {"tiny", "blocked", "rank", "pcfg", "lds"} <= set(models)
    assert all(m.object == "model" for m in models.values())
    assert oa.models.retrieve("tiny").id == "tiny"


@pytest.mark.parametrize("model", CHAINS)
def test_seeded_choices_equal_v1_sample(server, oa, model):
    c = oa.completions.create(model=model, prompt="w1 w2", max_tokens=6, n=3, seed=11)
    assert c.object == "text_completion" and c.model == model and c.id.startswith("cmpl-") and c.created > 0
    samples = sample(server, model, prefix="w1 w2", max_tokens=6, n=3, seed=11)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    for ch, s in zip(c.choices, samples, strict=True):
        assert ch.text == "".join(" " + w for w in completion_words(s))
        assert ch.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[s["finish_reason"]]
        assert ch.logprobs is None
    assert c.usage.prompt_tokens == 2
    assert c.usage.completion_tokens == sum(len(s["ids"]) for s in samples)
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    again = oa.completions.create(model=model, prompt="w1 w2", max_tokens=6, n=3, seed=11)
    assert [ch.text for ch in again.choices] == [ch.text for ch in c.choices]


@pytest.mark.parametrize("model", PREDICTIVE)
def test_settings_map_to_v1_sample(server, oa, model):
    """temperature, top_p and stop reach the sampler as /v1/sample takes them; temperature 0 is top_k 1."""
    c = oa.completions.create(model=model, prompt="w3", max_tokens=8, n=4, seed=5, temperature=0.7, top_p=0.8,
                              stop=["w1", "w2 w3"])
    samples = sample(server, model, prefix="w3", max_tokens=8, n=4, seed=5, temperature=0.7, top_p=0.8,
                     stop=["w1", "w2 w3"])
    assert [ch.text for ch in c.choices] == ["".join(" " + w for w in completion_words(s)) for s in samples]
    greedy = oa.completions.create(model=model, prompt="w3", max_tokens=5, temperature=0, seed=1, logprobs=3)
    (s,) = sample(server, model, prefix="w3", max_tokens=5, top_k=1, seed=1)
    assert greedy.choices[0].text == "".join(" " + w for w in completion_words(s))
    lp = greedy.choices[0].logprobs
    for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert max(top, key=top.get) == tok  # greedy: each token is the most probable next token


@pytest.mark.parametrize("model", CHAINS)
def test_logprobs_are_score_token_logprobs_and_exact_alternatives(server, oa, model):
    c = oa.completions.create(model=model, prompt="w4 w5 w6", max_tokens=5, n=2, seed=3, logprobs=4, echo=True)
    samples = sample(server, model, prefix="w4 w5 w6", max_tokens=5, n=2, seed=3)
    words = vocab(server, model)
    index = {w: i for i, w in enumerate(words)}
    prompt = [index["w4"], index["w5"], index["w6"]]
    for ch, s in zip(c.choices, samples, strict=True):
        ids = prompt + (s["ids"][:-1] if s["finish_reason"] == "eos" else s["ids"])
        (scored,) = score(server, model, [ids])
        lp = ch.logprobs
        assert ch.text == "w4 w5 w6" + "".join(" " + w for w in completion_words(s))
        assert [t.strip() for t in lp.tokens] == [words[i] for i in ids]
        assert "".join(lp.tokens) == ch.text
        assert lp.text_offset == [ch.text.index(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True)]
        assert len(lp.token_logprobs) == len(ids)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs, scored, strict=True)) <= TOL
        for t, top in enumerate(lp.top_logprobs):
            assert lp.tokens[t] in top and top[lp.tokens[t]] == lp.token_logprobs[t]
            assert 4 <= len(top) <= 5
    # the alternatives are the most probable next tokens of p(. | w4 w5): every token scored after the prefix
    t = 2
    top = c.choices[0].logprobs.top_logprobs[t]
    nexts = score(server, model, [prompt[:t] + [v] for v in range(len(words))])
    exact = sorted(((row[-1], v) for v, row in enumerate(nexts)), reverse=True)
    for w, lp in top.items():
        assert abs(lp - nexts[index[w.strip()]][-1]) <= 1e-5, (w, lp)
    best = sorted(top.items(), key=lambda kv: -kv[1])[:4]
    assert {index[w.strip()] for w, _ in best} == {v for _, v in exact[:4]}


def test_stream_chunks_rebuild_the_completion(server, oa):
    whole = oa.completions.create(model="tiny", prompt="w1", max_tokens=6, n=2, seed=9, logprobs=2)
    stream = oa.completions.create(model="tiny", prompt="w1", max_tokens=6, n=2, seed=9, logprobs=2, stream=True,
                                   stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    token_lps: dict[int, list[float]] = {}
    usage = None
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                token_lps.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason
    assert texts == {ch.index: ch.text for ch in whole.choices}
    assert reasons == {ch.index: ch.finish_reason for ch in whole.choices}
    assert token_lps == {ch.index: ch.logprobs.token_logprobs for ch in whole.choices if ch.logprobs.tokens}
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens
    raw = server.client.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2,
                                                      "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_several_prompts_and_token_ids(server, oa):
    """Prompt i's choices are at indices i n .. i n + n - 1, each prompt drawn as /v1/sample draws it."""
    words = vocab(server, "blocked")
    ids = [[words.index("w2"), words.index("w7")], [words.index("w9")]]
    c = oa.completions.create(model="blocked", prompt=ids, max_tokens=4, n=2, seed=21)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    for i, p in enumerate(ids):
        samples = sample(server, "blocked", prefix=p, max_tokens=4, n=2, seed=21)
        assert [ch.text for ch in c.choices[2 * i: 2 * i + 2]] == [
            "".join(" " + w for w in completion_words(s)) for s in samples]
    texts = oa.completions.create(model="blocked", prompt=["w2 w7", "w9"], max_tokens=4, n=2, seed=21)
    assert [ch.text for ch in texts.choices] == [ch.text for ch in c.choices]
    one = oa.completions.create(model="blocked", prompt=ids[1], max_tokens=4, n=2, seed=21)
    assert [ch.text for ch in one.choices] == [ch.text for ch in c.choices[2:]]
    start = oa.completions.create(model="blocked", prompt="", max_tokens=4, seed=2)
    (s,) = sample(server, "blocked", max_tokens=4, seed=2)
    assert start.choices[0].text == " ".join(completion_words(s))


@pytest.mark.parametrize("model", CHAINS)
def test_echo_without_generation_scores_the_prompt(server, oa, model):
    c = oa.completions.create(model=model, prompt=["w1 w2 w3", "w8"], max_tokens=0, echo=True, logprobs=0)
    words = vocab(server, model)
    seqs = [[words.index(w) for w in p.split()] for p in ("w1 w2 w3", "w8")]
    for ch, lps in zip(c.choices, score(server, model, seqs), strict=True):
        assert ch.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(ch.logprobs.token_logprobs, lps, strict=True)) <= TOL
        assert [list(t) for t in ch.logprobs.top_logprobs] == [[t] for t in ch.logprobs.tokens]
    assert c.usage.completion_tokens == 0 and c.usage.prompt_tokens == 4


def test_async_openai_client(server):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await client.completions.create(model="rank", prompt="w1", max_tokens=3, seed=4)

    c = asyncio.run(go())
    (s,) = sample(server, "rank", prefix="w1", max_tokens=3, seed=4)
    assert c.choices[0].text == "".join(" " + w for w in completion_words(s))


@pytest.mark.parametrize(("model", "fields", "param"), [
    ("pcfg", {}, "model"),
    ("lds", {}, "model"),
    ("tiny", {"suffix": "w3"}, "suffix"),
    ("tiny", {"best_of": 3, "n": 2}, "best_of"),
    ("tiny", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("tiny", {"presence_penalty": 0.5}, "presence_penalty"),
    ("tiny", {"frequency_penalty": -1.0}, "frequency_penalty"),
    ("rank", {"top_p": 0.5}, "top_p"),
    ("rank", {"temperature": 0}, "temperature"),
])
def test_unsupported_answers_400_naming_the_field(oa, model, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=model, prompt="w1", max_tokens=2, **fields)
    err = openai_error(info.value)
    assert err["param"] == param and info.value.param == param, err
    assert err["type"] == "invalid_request_error"


def test_accepted_no_op_fields(oa):
    c = oa.completions.create(model="tiny", prompt="w1", max_tokens=2, seed=1, best_of=1, logit_bias={},
                              presence_penalty=0, frequency_penalty=0, user="someone", top_p=1)
    d = oa.completions.create(model="tiny", prompt="w1", max_tokens=2, seed=1)
    assert c.choices[0].text == d.choices[0].text


def test_constraint_through_extra_body(server, oa):
    """A constraint in `extra_body` conditions every choice exactly as /v1/sample's `constraint` does: the same
    seeded draws, each containing the keyword and ending at <eos> (finish_reason "stop"); a malformed constraint is
    refused naming its field."""
    constraint = {"include": [["w5"]], "max_tokens": 6}
    c = oa.completions.create(model="tiny", prompt="w1", max_tokens=6, n=4, seed=1,
                              extra_body={"constraint": constraint})
    want = server.client.post("/v1/sample", json={"model": "tiny", "prefix": "w1", "n": 4, "max_tokens": 6,
                                                  "seed": 1, "constraint": constraint}).json()["data"]
    assert [ch.text.split() for ch in c.choices] == [d["tokens"][:-1] for d in want]  # <eos> left out of text
    assert all("w5" in ch.text.split() and ch.finish_reason == "stop" for ch in c.choices), c.choices
    with pytest.raises(openai.UnprocessableEntityError) as e:
        oa.completions.create(model="tiny", prompt="w1", max_tokens=3, extra_body={"constraint": {"words": ["w5"]}})
    assert openai_error(e.value)["param"] == "constraint.words"


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"logprobs": 50}, "logprobs"),
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"seed": -3}, "seed"),
    ({"stop": ["w1", "w2", "w3", "w4", "w5"]}, "stop"),
    ({"stop": "nosuchword"}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_values_answer_422_naming_the_field(oa, fields, param):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        oa.completions.create(model="tiny", prompt="w1", max_tokens=fields.pop("max_tokens", 2), **fields)
    assert openai_error(info.value)["param"] == param


def test_bad_bodies(server):
    post = server.client.post
    cases = [({"model": "tiny", "prompt": []}, 422, "prompt"),
             ({"model": "tiny", "prompt": [[]]}, 422, "prompt"),
             ({"model": "tiny", "prompt": [[0, 999]]}, 422, "prompt"),
             ({"model": "tiny", "prompt": "w1", "nonsense": 1}, 422, "nonsense"),
             ({"model": "tiny"}, 422, "prompt"),
             ({"model": "nosuch", "prompt": "w1"}, 404, "model"),
             ({"model": "tiny", "prompt": "w1", "n": 100, "max_tokens": 2000}, 413, "max_tokens")]
    for body, status, param in cases:
        r = post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"].startswith(param), (body, err)


def test_a_batch_line_answers_as_the_route(server, store, tmp_path):
    """Completions is an operation like the others (`ops.completions`, declared in `ops.spec`): a batch line of
    /v1/completions (`jobs.execute_lines`, the batch API's runner) answers the route's body but its fresh `id`,
    and a refused line the route's error."""
    from latentlm.service.jobs import execute_lines
    from latentlm.service.registry import ModelRegistry
    from latentlm.service.settings import Settings

    from .conftest import close

    settings = Settings(store=store, device="cpu", calibrate=False, state_dir=tmp_path)
    registry = ModelRegistry.from_settings(settings)
    registry.reload()
    bodies = [{"model": "tiny", "prompt": ["w1", "w2 w3"], "max_tokens": 6, "n": 2, "seed": 7, "logprobs": 2,
               "constraint": {"include": [["w5"]]}},
              {"model": "blocked", "prompt": "w4", "max_tokens": 0, "echo": True, "logprobs": 1},
              {"model": "pcfg", "prompt": "w1"}, {"model": "tiny", "prompt": "w1", "suffix": "w2"}]
    for (status, got), body in zip(execute_lines(registry, "completions", bodies, settings), bodies, strict=True):
        r = server.client.post("/v1/completions", json=body)
        want = r.json()
        assert status == r.status_code, (body, got, want)
        if status == 200:
            assert got.pop("id").startswith("cmpl-") and got.pop("created") > 0
            want.pop("id"), want.pop("created")
        close(got, want, path=str(body))
