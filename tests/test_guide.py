"""The guide for neural LMs: `latentlm.ops.guide.ConstraintLogitsProcessor` (in process, incremental) and
`latentlm.guide_client.RemoteConstraintLogitsProcessor` (over REST, a real `latentlm serve` subprocess), driving a
small randomly initialised `transformers` GPT-2 built from a config whose vocabulary is a stored HMM's.

Checked: every generated text (sampling with several seeds and batch rows, greedy, beam search) satisfies its
constraint, by the compiled automaton and by an independent checker on the words; the weights equal brute-force
conditionals P(C | x, y, v) on tiny models (in process and through the `generated` field of POST /v1/constraint);
the in-process guide reads one token per row per step (spied: one filter step each, no prefix rescan); rows
reordered between steps (beams) are followed; errors name the argument."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient

from latentlm import ops
from latentlm.client import APIError, Client
from latentlm.guide_client import RemoteConstraintLogitsProcessor
from latentlm.models import constrained
from latentlm.models.constraint import WordDFA
from latentlm.models.errors import InputError
from latentlm.models.registry import save_artifact
from latentlm.ops import constrain
from latentlm.ops.constrain import Limits
from latentlm.ops.guide import ConstraintLogitsProcessor
from latentlm.service.app import create_app
from latentlm.service.settings import Settings
from tests.models.test_constrained import VOCAB as TINY_VOCAB
from tests.models.test_constrained import continuations, model, naive_satisfies, prefix_prob
from tests.service.conftest import Server, add_model, vocab
from tests.service.test_constraint_api import tensors

transformers = pytest.importorskip("transformers")  # the test extra pins it; a core install has no transformers
transformers.logging.set_verbosity_error()

VOCAB = vocab()  # w0 .. w37, <unk>, <eos>
V = len(VOCAB)
EOS = VOCAB.eos_id
SPECS = [
    {"include": [["w3", "w4 w5"], ["w7"]], "ordered": True, "exclude": ["w1", "w9 w9"], "min_tokens": 4,
     "max_tokens": 12},
    {"include": [["w11"], ["w2 w6", "w20"]], "exclude": ["w0"], "suffix": "w8", "max_tokens": 10},
    {"regex": "w5 . * [w2 w3] .", "exclude": ["w4"], "min_tokens": 3, "max_tokens": 8},
]
STORE_MODELS = {"hmm": "hmm", "blocked": "blocked_hmm", "rank": "rank_hmm"}


def lm(vocab_size: int = V, seed: int = 0):
    """A 1-layer GPT-2 with random weights (no download) whose token ids are the HMM's words."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=vocab_size, n_positions=64,
                                     bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    return transformers.GPT2LMHeadModel(config).eval()


def words_satisfy(spec: dict, words: list[str]) -> bool:
    """An independent check on the words (no automaton): the window, one final <eos>, include groups (first
    occurrences' ends in order when `ordered`), excluded phrases, the suffix; `regex` only in the form of SPECS[2]."""
    if not (spec.get("min_tokens", 1) <= len(words) <= spec["max_tokens"]) or words[-1] != "<eos>":
        return False
    u = words[:-1]
    if "<eos>" in u:
        return False

    def ends(phrase: str) -> list[int]:
        p = phrase.split()
        return [i + len(p) for i in range(len(u) - len(p) + 1) if u[i:i + len(p)] == p]

    if any(ends(x) for x in spec.get("exclude", [])):
        return False
    firsts = []
    for group in spec.get("include", []):
        found = [e for alt in group for e in ends(alt)]
        if not found:
            return False
        firsts.append(min(found))
    if spec.get("ordered") and firsts != sorted(firsts):
        return False
    if "suffix" in spec and u[len(u) - len(spec["suffix"].split()):] != spec["suffix"].split():
        return False
    if "regex" in spec:  # "w5 . * [w2 w3] ."
        if not (len(u) >= 3 and u[0] == "w5" and u[-2] in ("w2", "w3")):
            return False
    return True


def continuations_of(out: torch.Tensor, prompt_length: int) -> list[list[int]]:
    """generate's rows -> their continuations up to and including the first <eos> (the whole row without one)."""
    conts = []
    for row in out[:, prompt_length:].tolist():
        conts.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return conts


def check_all(dfa: WordDFA, spec: dict, out: torch.Tensor, prompt_length: int) -> None:
    """Every row of generate's output ends inside the window with <eos> and satisfies the constraint, by the
    compiled automaton and by the independent checker."""
    for c in continuations_of(out, prompt_length):
        words = VOCAB.decode(c)
        assert c[-1] == EOS, words
        assert dfa.satisfied(c), words
        assert words_satisfy(spec, words), (spec, words)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("guide-store")
    for seed, (name, family) in enumerate(STORE_MODELS.items()):
        add_model(path, name, family, seed=seed)
    for fam in ("hmm", "blocked_hmm"):  # the enumeration models (words a b c d <eos>)
        t, c = tensors(fam)
        save_artifact(path, f"tiny-{fam}", fam, t, TINY_VOCAB, config=c)
    return path


@pytest.fixture(scope="module")
def loaded(store):
    return {name: ops.load_model(store, name, dtype="float64") for name in STORE_MODELS}


GENERATIONS = [("sample", {"do_sample": True, "num_return_sequences": 4}, seed) for seed in range(3)] + [
    ("greedy", {"do_sample": False}, 0), ("beam", {"do_sample": False, "num_beams": 3, "num_return_sequences": 3}, 0)]


@pytest.mark.parametrize("name", STORE_MODELS)
@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_every_generated_text_satisfies_the_constraint_in_process(loaded, name, spec):
    net = lm()
    prompt = torch.tensor([[EOS, 2, 9], [EOS, 14, 3]])  # a start-of-text token, then two HMM words
    for _, kwargs, seed in GENERATIONS:
        proc = ConstraintLogitsProcessor(loaded[name], spec)
        torch.manual_seed(seed)
        out = net.generate(prompt, attention_mask=torch.ones_like(prompt), logits_processor=[proc],
                           **proc.generate_kwargs(), **kwargs)
        check_all(proc.dfa, spec, out, prompt.shape[1])
        # the rows continued their own prompts: the guide's filter started from each row's words
        assert len(continuations_of(out, 3)) == len(out)


def test_a_larger_lm_vocabulary_never_generates_the_extra_ids(loaded):
    """Extra ids declared as padding (lm_vocab_size, or the LM's config) get weight 0; undeclared, they are refused."""
    spec = SPECS[0]
    net = lm(vocab_size=V + 24, seed=1)
    with pytest.raises(InputError) as e:
        ConstraintLogitsProcessor(loaded["hmm"], spec)(torch.tensor([[EOS]]), torch.zeros(1, V + 24))
    assert e.value.param == "scores" and "lm_vocab_size" in str(e.value)
    with pytest.raises(InputError) as e:  # declared, but not what the LM gives
        ConstraintLogitsProcessor(loaded["hmm"], spec, lm_vocab_size=V + 24)(torch.tensor([[EOS]]),
                                                                            torch.zeros(1, V + 25))
    assert e.value.param == "scores"
    for seed in range(2):
        proc = ConstraintLogitsProcessor(loaded["hmm"], spec, prefix="w2 w9", config=net.config)
        torch.manual_seed(seed)
        out = net.generate(torch.tensor([[EOS]]), do_sample=True, num_return_sequences=6, logits_processor=[proc],
                           **proc.generate_kwargs())
        assert int(out.max()) < V
        check_all(proc.dfa, spec, out, 1)


def test_one_filter_step_per_token_and_row(loaded, monkeypatch):
    """Spies (the real functions, counted): the prefix filter runs once per row at the first call; afterwards each
    call conditions every live row on exactly its newest token."""
    advanced: list[int] = []
    initial: list[int] = []
    real_advance, real_initial = constrained._advance, constrained.Messages.initial

    def advance(msgs, a, q, words):
        advanced.append(len(words))
        return real_advance(msgs, a, q, words)

    def first(self, prefix=None):
        initial.append(len(prefix or ()))
        return real_initial(self, prefix)

    monkeypatch.setattr(constrained, "_advance", advance)
    monkeypatch.setattr(constrained.Messages, "initial", first)
    proc = ConstraintLogitsProcessor(loaded["blocked"], SPECS[0])
    torch.manual_seed(0)
    out = lm().generate(torch.tensor([[EOS, 4, 5, 6, 7]]), do_sample=True, num_return_sequences=3,
                        logits_processor=[proc], **proc.generate_kwargs())
    check_all(proc.dfa, SPECS[0], out, 5)
    calls = out.shape[1] - 5  # one per generated position
    assert initial == [4, 4, 4]  # each row's prompt read once, at the first call (the leading <eos> dropped)
    assert proc.guide is not None and proc.guide.steps == calls - 1
    # every content token of every row conditioned on exactly once (its <eos> ends the row), at most one
    # filter step (over the rows still generating) per call after the first
    assert sum(advanced) == sum(len(c) - 1 for c in continuations_of(out, 5))
    assert len(advanced) <= calls - 1 and max(advanced) <= 3


def test_rows_reordered_between_steps_are_followed(loaded):
    """Beam search moves rows: a processor that saw them move gives what a fresh one fed the new order gives."""
    spec = SPECS[0]
    scores = torch.zeros(2, V)
    moved, fresh = (ConstraintLogitsProcessor(loaded["hmm"], spec) for _ in range(2))
    moved(torch.tensor([[EOS, 2], [EOS, 2]]), scores)
    moved(torch.tensor([[EOS, 2, 3], [EOS, 2, 12]]), scores)
    fresh(torch.tensor([[EOS, 2], [EOS, 2]]), scores)
    fresh(torch.tensor([[EOS, 2, 12], [EOS, 2, 3]]), scores)
    step = torch.tensor([[EOS, 2, 12, 5], [EOS, 2, 3, 7]])  # w3 before w7: both rows can still satisfy C
    a, b = moved(step, scores), fresh(step, scores)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # the rows' histories differ, and so do their weights
    with pytest.raises(InputError) as e:
        moved(torch.tensor([[EOS, 2, 12, 5, 6], [EOS, 2, 9, 9, 6]]), scores)
    assert e.value.param == "input_ids"


def enumerated_weights(family: str, prefix: tuple[int, ...], generated: tuple[int, ...], spec: dict) -> list[float]:
    """P(C | x, y, v) for every v by enumeration: the mass of complete continuations of x starting with y v that
    satisfy C, over p(y v | x)."""
    m = model(family)
    conts = continuations(family, prefix)
    p_x = prefix_prob(m, prefix)
    out = []
    for v in range(len(TINY_VOCAB)):
        head = generated + (v,)
        p_head = prefix_prob(m, prefix + head) / p_x
        sat = sum(p for y, p in conts.items() if y[: len(head)] == head and naive_satisfies(spec, y))
        out.append(sat / p_head if p_head > 0 else 0.0)
    return out


TINY_CASES = [  # (constraint, the words y read one by one after the prefix "c": each keeps C possible)
    ({"include": [["a", "b c"], ["d"]], "max_tokens": 6}, (0, 3, 1)),
    ({"include": [["c"], ["a"]], "ordered": True, "exclude": ["d"], "max_tokens": 6}, (2, 1, 0)),
]


@pytest.mark.parametrize("family", ["hmm", "blocked_hmm"])
@pytest.mark.parametrize("case", TINY_CASES, ids=range(len(TINY_CASES)))
def test_weights_equal_enumeration_in_process_and_over_rest(store, family, case):
    spec, words = case
    loaded_tiny = ops.load_model(store, f"tiny-{family}", dtype="float64")
    app = create_app(Settings(store=store, device="cpu", dtype="float64", state_dir=store.parent / f"st-{family}"))
    prefix, path = (2,), [words[:j] for j in range(len(words) + 1)]
    with TestClient(app) as client:
        while client.get("/ready").status_code != 200:
            pass
        proc = ConstraintLogitsProcessor(loaded_tiny, spec)
        zeros = torch.zeros(1, len(TINY_VOCAB), dtype=torch.float64)
        for generated in path:
            want = enumerated_weights(family, prefix, generated, spec)
            got_in_process = proc(torch.tensor([[*prefix, *generated]]), zeros)[0].exp().tolist()
            r = client.post("/v1/constraint", json={"model": f"tiny-{family}", "prefix": list(prefix),
                                                    "generated": list(generated), "constraint": spec,
                                                    "weights": True})
            assert r.status_code == 200, r.text
            for v in range(len(TINY_VOCAB)):
                assert math.isclose(got_in_process[v], want[v], rel_tol=1e-9, abs_tol=1e-12), (generated, v)
                assert math.isclose(r.json()["weights"][v], want[v], rel_tol=1e-9, abs_tol=1e-12), (generated, v)
        r = client.post("/v1/constraint", json={"model": f"tiny-{family}", "generated": [0, 4], "constraint": spec})
        assert r.status_code == 422 and r.json()["error"]["param"] == "generated"
        r = client.post("/v1/constraint", json={"model": f"tiny-{family}", "generated": [0, 9], "constraint": spec})
        assert r.status_code == 422 and r.json()["error"]["param"] == "generated"


def test_errors_name_the_argument(loaded):
    with pytest.raises(InputError) as e:
        ConstraintLogitsProcessor(loaded["hmm"], {"include": [["zebra"]]})
    assert e.value.param.startswith("constraint.include") and "zebra" in str(e.value)
    with pytest.raises(InputError) as e:
        ConstraintLogitsProcessor(loaded["hmm"], {"include": [["w1"]], "exclude": ["w1"]})
    assert e.value.param.startswith("constraint")
    proc = ConstraintLogitsProcessor(loaded["hmm"], SPECS[0])
    with pytest.raises(InputError) as e:
        proc(torch.tensor([[EOS]]), torch.zeros(1, V - 1))
    assert e.value.param == "scores"
    proc(torch.tensor([[EOS]]), torch.zeros(1, V))
    with pytest.raises(InputError) as e:  # a second generate call on the same processor
        proc(torch.tensor([[EOS]]), torch.zeros(1, V))
    assert e.value.param == "input_ids"
    with pytest.raises(InputError) as e:  # a prompt id outside the HMM's vocabulary (a larger LM's)
        ConstraintLogitsProcessor(loaded["hmm"], SPECS[0], lm_vocab_size=V + 8)(torch.tensor([[V + 3]]),
                                                                                torch.zeros(1, V + 8))
    assert e.value.param == "input_ids"
    # a processor before the guide that ruled out every token the constraint allows
    proc = ConstraintLogitsProcessor(loaded["hmm"], {"include": [["w3"]], "max_tokens": 2})
    proc(torch.tensor([[EOS]]), torch.zeros(1, V))
    with pytest.raises(InputError) as e:
        proc(torch.tensor([[EOS, 3]]), torch.zeros(1, V).index_fill_(1, torch.tensor([EOS]), -math.inf))
    assert e.value.param == "scores"


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    s = Server(store, tmp_path_factory.mktemp("guide-serve"), env={"LATENTLM_DTYPE": "float64"})
    yield s
    s.stop()


@pytest.mark.parametrize("name", ["hmm", "blocked"])
def test_every_generated_text_satisfies_the_constraint_over_rest(server, loaded, name):
    spec = SPECS[0]
    dfa = constrain.compile_for(loaded[name], spec, Limits())
    net = lm(seed=2)
    prompt = torch.tensor([[EOS, 2, 9]])
    with Client(server.url) as client:
        for _, kwargs, seed in GENERATIONS[:2] + GENERATIONS[3:]:
            proc = RemoteConstraintLogitsProcessor(client, name, spec)
            assert proc.eos_token_id == EOS and proc.max_tokens == spec["max_tokens"]
            torch.manual_seed(seed)
            out = net.generate(prompt, attention_mask=torch.ones_like(prompt), logits_processor=[proc],
                               **proc.generate_kwargs(), **kwargs)
            check_all(dfa, spec, out, prompt.shape[1])
            assert proc.requests <= out.shape[0] * (out.shape[1] - prompt.shape[1])


def test_rest_and_in_process_give_the_same_scores_at_every_step(server, loaded):
    """One sampled generation, steered in process; the REST processor, fed the same rows step by step, adds the
    same log-weights (float64 on both sides; the scores are the LM's float32)."""
    spec, steps = SPECS[1], []
    local = ConstraintLogitsProcessor(loaded["rank"], spec)

    class Recording:
        def __call__(self, input_ids, scores):
            out = local(input_ids, scores)
            steps.append((input_ids.clone(), scores.clone(), out.clone()))
            return out

    torch.manual_seed(5)
    lm(seed=3).generate(torch.tensor([[EOS, 11]]), do_sample=True, num_return_sequences=3,
                        logits_processor=[Recording()], **local.generate_kwargs())
    remote = RemoteConstraintLogitsProcessor(server.url, "rank", spec)
    try:
        for input_ids, scores, want in steps:
            got = remote(input_ids, scores)
            assert torch.equal(torch.isfinite(got), torch.isfinite(want))
            fin = torch.isfinite(want)
            assert torch.allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)
    finally:
        remote.close()


def test_rest_errors_name_the_field(server):
    with Client(server.url) as client:
        with pytest.raises(APIError) as e:
            RemoteConstraintLogitsProcessor(client, "hmm", {"include": [["zebra"]]})
        assert e.value.status == 422 and e.value.param.startswith("constraint.include")
        with pytest.raises(APIError) as e:
            RemoteConstraintLogitsProcessor(client, "hmm", SPECS[0], eos_token_id=3)
        assert e.value.param == "eos_token_id"
        with pytest.raises(APIError) as e:
            RemoteConstraintLogitsProcessor(client, "hmm", {"include": [["w3"]], "exclude": ["w3"]})
        assert e.value.status == 422 and e.value.param.startswith("constraint")
