"""The guide with an LM that has its own tokenizer: a tiny randomly initialised GPT-2 built from a config over a
byte-level BPE trained in the test (as a `transformers` fast tokenizer), steered by an HMM over that tokenizer's ids
(random weights), in process (`ConstraintLogitsProcessor`) and over REST (`RemoteConstraintLogitsProcessor` against
the app in process).

Checked: every guided output's decoded text satisfies its constraint (keywords as whole words, word counts, the
window; the independent text checker of tests/models/test_text_constraint.py), for sampling, greedy and beams, with
text prompts; alpha = 0 is the plain LM, alpha weighs log g; a vocabulary the HMM does not share is refused naming
`scores` (an LM with more ids than the HMM, undeclared), `tokenizer` (another tokenizer, or a word-level HMM) or
`eos_token_id`, and declared padding ids are never generated."""

from __future__ import annotations

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from latentlm import ops
from latentlm.client import APIError, Client
from latentlm.guide_client import RemoteConstraintLogitsProcessor
from latentlm.models.errors import InputError
from latentlm.ops.guide import ConstraintLogitsProcessor
from latentlm.service.app import create_app
from latentlm.service.settings import Settings
from tests.helpers_tokenizer import EOS, make_bpe_tokenizer, make_metaspace_tokenizer, make_tokenizer_hmm_store
from tests.models.test_text_constraint import satisfies
from tests.service.conftest import add_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

HF = make_bpe_tokenizer(400)
FAST = transformers.PreTrainedTokenizerFast(tokenizer_object=HF, eos_token=EOS)
V = 400
EOS_ID = 0
SPECS = [
    {"include": [["apple"]], "max_tokens": 10},
    {"include": [["river"], ["apple"]], "ordered": True, "max_words": 8, "max_tokens": 14},
    {"include": [["café", "Zürich"]], "exclude": ["the"], "min_words": 3, "max_tokens": 12},
]


def lm(vocab_size: int = V, seed: int = 0, eos: int = EOS_ID):
    """A 1-layer GPT-2 with random weights (no download) over the tokenizer's ids (vocab_size may pad them)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=vocab_size, n_positions=64,
                                     bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("guide-text-store")
    make_tokenizer_hmm_store(path, "bpe", HF, states=4, seed=5)
    add_model(path, "words", "hmm", seed=0)
    return path


@pytest.fixture(scope="module")
def hmm(store):
    return ops.load_model(store, "bpe", dtype="float64")


def continuations(out: torch.Tensor, prompt_length: int) -> list[list[int]]:
    conts = []
    for row in out[:, prompt_length:].tolist():
        conts.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return conts


def check_all(proc, spec: dict, out: torch.Tensor, prompt_length: int) -> None:
    for c in continuations(out, prompt_length):
        text = HF.decode(c[:-1], skip_special_tokens=False)
        assert c[-1] == EOS_ID and proc.dfa.satisfied(c), text
        assert satisfies(spec, text, len(c)), (spec, text)


GENERATIONS = [({"do_sample": True, "num_return_sequences": 4}, seed) for seed in range(2)] + [
    ({"do_sample": False}, 0), ({"do_sample": False, "num_beams": 3, "num_return_sequences": 2}, 0)]


@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_every_guided_text_satisfies_the_constraint(hmm, spec):
    net = lm(seed=1)
    prompt = torch.tensor([[EOS_ID, *FAST("The river", add_special_tokens=False).input_ids]])
    for kwargs, seed in GENERATIONS:
        proc = ConstraintLogitsProcessor(hmm, spec, tokenizer=FAST, config=net.config)
        torch.manual_seed(seed)
        out = net.generate(prompt, attention_mask=torch.ones_like(prompt), logits_processor=[proc],
                           **proc.generate_kwargs(), **kwargs)
        check_all(proc, spec, out, prompt.shape[1])
    # a text prefix for the HMM, encoded by its tokenizer
    proc = ConstraintLogitsProcessor(hmm, spec, prefix="The river", tokenizer=FAST, alpha=0.5)
    torch.manual_seed(3)
    start = torch.tensor([[EOS_ID]])
    out = net.generate(start, attention_mask=torch.ones_like(start), logits_processor=[proc], do_sample=True,
                       num_return_sequences=3, **proc.generate_kwargs())
    check_all(proc, spec, out, 1)


def test_alpha_zero_is_the_plain_lm_and_alpha_weighs_log_g(hmm):
    net = lm(seed=2)
    prompt = torch.tensor([[EOS_ID]])
    proc = ConstraintLogitsProcessor(hmm, SPECS[0], tokenizer=FAST, alpha=0.0)
    torch.manual_seed(7)
    guided = net.generate(prompt, attention_mask=torch.ones_like(prompt), logits_processor=[proc], do_sample=True,
                          num_return_sequences=3, **proc.generate_kwargs())
    torch.manual_seed(7)
    plain = net.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, num_return_sequences=3,
                         **proc.generate_kwargs())
    assert torch.equal(guided, plain)
    scores = torch.randn(1, V, dtype=torch.float64)
    one, half = (ConstraintLogitsProcessor(hmm, SPECS[0], alpha=a) for a in (1.0, 0.5))
    a, b = one(prompt, scores), half(prompt, scores)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)) and not torch.isfinite(a).all()
    fin = torch.isfinite(a)
    assert torch.allclose(b[fin] - scores[fin], 0.5 * (a[fin] - scores[fin]), rtol=1e-12, atol=1e-12)
    with pytest.raises(InputError) as e:
        ConstraintLogitsProcessor(hmm, SPECS[0], alpha=-1)
    assert e.value.param == "alpha"


def test_a_vocabulary_the_hmm_does_not_share_is_refused(hmm, store):
    ids = torch.tensor([[EOS_ID]])
    with pytest.raises(InputError) as e:  # 50 ids more than the HMM's, undeclared
        ConstraintLogitsProcessor(hmm, SPECS[0])(ids, torch.zeros(1, V + 50))
    assert e.value.param == "scores"
    with pytest.raises(InputError) as e:  # GPT-2's 50,257 ids against a word-level HMM's 40 words
        ConstraintLogitsProcessor(ops.load_model(store, "words"), {"include": [["w3"]]})(ids, torch.zeros(1, 50257))
    assert e.value.param == "scores"
    with pytest.raises(InputError) as e:
        ConstraintLogitsProcessor(ops.load_model(store, "words"), {"include": [["w3"]]}, tokenizer=FAST)
    assert e.value.param == "tokenizer"
    for other in (make_bpe_tokenizer(300), make_metaspace_tokenizer()):
        with pytest.raises(InputError) as e:
            ConstraintLogitsProcessor(hmm, SPECS[0], tokenizer=other)
        assert e.value.param == "tokenizer"
    with pytest.raises(InputError) as e:
        ConstraintLogitsProcessor(hmm, SPECS[0], eos_token_id=5)
    assert e.value.param == "eos_token_id"
    with pytest.raises(InputError) as e:
        ConstraintLogitsProcessor(hmm, SPECS[0], config=lm(eos=7).config)
    assert e.value.param == "eos_token_id"
    # the same tokenizer however given (its file, a tokenizers.Tokenizer) passes; so does ids_match
    ConstraintLogitsProcessor(hmm, SPECS[0], tokenizer=store / "bpe" / "tokenizer.json")
    ConstraintLogitsProcessor(hmm, SPECS[0], tokenizer=HF)
    ConstraintLogitsProcessor(hmm, SPECS[0], ids_match=True)(ids, torch.zeros(1, V + 50))


@pytest.mark.parametrize("declare", ["lm_vocab_size", "config", "tokenizer"])
def test_declared_padding_ids_are_never_generated(hmm, declare):
    net = lm(vocab_size=V + 50, seed=4)
    kw = {"lm_vocab_size": {"lm_vocab_size": V + 50}, "config": {"config": net.config},
          "tokenizer": {"tokenizer": FAST}}[declare]
    proc = ConstraintLogitsProcessor(hmm, SPECS[0], **kw)
    torch.manual_seed(0)
    prompt = torch.tensor([[EOS_ID]])
    out = net.generate(prompt, attention_mask=torch.ones_like(prompt), logits_processor=[proc], do_sample=True,
                       num_return_sequences=4, **proc.generate_kwargs())
    assert int(out.max()) < V
    check_all(proc, SPECS[0], out, 1)


class Via(httpx.BaseTransport):
    """`latentlm.client.Client` requests answered by the app in process (through a TestClient)."""

    def __init__(self, tc: TestClient):
        self.tc = tc

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.tc.request(request.method, request.url.path, headers=dict(request.headers), content=request.read())
        headers = {k: v for k, v in r.headers.items() if k.lower() not in ("content-encoding", "content-length")}
        return httpx.Response(r.status_code, headers=headers, content=r.content)


@pytest.fixture(scope="module")
def client(store, tmp_path_factory):
    app = create_app(Settings(store=store, device="cpu", dtype="float64", state_dir=tmp_path_factory.mktemp("st")))
    with TestClient(app) as tc:
        while tc.get("/ready").status_code != 200:
            pass
        with Client("http://testserver", transport=Via(tc), max_retries=0) as c:
            yield c


def test_over_rest(hmm, client):
    spec = SPECS[1]
    net = lm(seed=5)
    prompt = torch.tensor([[EOS_ID, *FAST("The", add_special_tokens=False).input_ids]])
    assert client.model("bpe")["vocabulary_sha256"] and "vocabulary_sha256" not in client.model("words")
    proc = RemoteConstraintLogitsProcessor(client, "bpe", spec, tokenizer=FAST, config=net.config)
    local = ConstraintLogitsProcessor(hmm, spec)
    assert proc.eos_token_id == EOS_ID
    torch.manual_seed(1)
    out = net.generate(prompt, attention_mask=torch.ones_like(prompt), logits_processor=[proc], do_sample=True,
                       num_return_sequences=2, **proc.generate_kwargs())
    check_all(local, spec, out, prompt.shape[1])
    scores = torch.randn(1, V, dtype=torch.float64)
    fresh = RemoteConstraintLogitsProcessor(client, "bpe", spec, alpha=0.5)
    got, want = fresh(prompt, scores), ConstraintLogitsProcessor(hmm, spec, alpha=0.5)(prompt, scores)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and torch.allclose(got[fin], want[fin], rtol=1e-9)
    assert RemoteConstraintLogitsProcessor(client, "bpe", spec, alpha=0)(prompt, scores) is scores
    for kwargs, param in [({"tokenizer": make_bpe_tokenizer(300)}, "tokenizer"), ({"eos_token_id": 5}, "eos_token_id"),
                          ({"config": lm(eos=7).config}, "eos_token_id")]:
        with pytest.raises(APIError) as e:
            RemoteConstraintLogitsProcessor(client, "bpe", spec, **kwargs)
        assert e.value.status == 422 and e.value.param == param
    with pytest.raises(APIError) as e:
        RemoteConstraintLogitsProcessor(client, "words", {"include": [["w3"]]}, tokenizer=FAST)
    assert e.value.param == "tokenizer"
    with pytest.raises(InputError) as e:
        RemoteConstraintLogitsProcessor(client, "bpe", spec)(prompt, torch.zeros(1, V + 50))
    assert e.value.param == "scores"
