"""models/tokenizer.py: an LM's tokenizer carried by a model store, its exact bytes per token checked against the
`tokenizers` library's own decoder on byte-level and Metaspace BPEs trained here (multi-byte characters split across
tokens), refusals of decoders it cannot reproduce, and the store's load path (hash, vocab size, eos)."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from latentlm.models.errors import ArtifactError, InputError
from latentlm.models.registry import load_artifact
from latentlm.models.tokenizer import TextTokenizer, byte_decoder, tokenizer_files, vocab_for
from tests.helpers_tokenizer import (
    EOS,
    SENTENCES,
    make_bpe_tokenizer,
    make_metaspace_tokenizer,
    make_tokenizer_hmm_store,
)

UNSEEN = ["Ørsted ß þ 🐍 and ĳ", "  two  leading spaces", "tabs\tand\nlines\n", "日本の東京 café naïve", "x"]


@pytest.fixture(scope="module")
def bpe():
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def meta():
    return make_metaspace_tokenizer()


def test_byte_table_is_gpt2s():
    table = byte_decoder()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    assert table["Ġ"] == 32 and table["Ċ"] == 10 and table["!"] == 33


def test_byte_level_round_trip_and_library_decode(bpe):
    t = TextTokenizer.from_hf(bpe)
    assert t.vocab_size == bpe.get_vocab_size() == 300 and t.special == {0} and t.token_bytes[0] == b""
    for text in SENTENCES + UNSEEN:
        ids = t.encode(text)
        assert ids == bpe.encode(text, add_special_tokens=False).ids
        assert t.decode(ids) == text == bpe.decode(ids) == t.decode_text(ids)
        assert b"".join(t.token_bytes[i] for i in ids) == text.encode()


def test_byte_level_random_ids_split_characters(bpe):
    """Random id sequences, many ending or starting inside a multi-byte character: the join of the tokens' bytes is
    the library's decode (U+FFFD where the bytes are not UTF-8), and `pieces` join to it exactly."""
    t = TextTokenizer.from_hf(bpe)
    rng = random.Random(0)
    multibyte = [i for i in range(t.vocab_size) if t.token_bytes[i] and t.token_bytes[i][0] >= 0x80]
    split_seen = 0
    for _ in range(500):
        ids = [rng.choice(multibyte) if rng.random() < 0.5 else rng.randrange(t.vocab_size)
               for _ in range(rng.randint(1, 12))]
        joined = b"".join(t.token_bytes[i] for i in ids)
        assert t.decode(ids) == joined.decode("utf-8", "replace") == bpe.decode(ids)
        pieces = t.pieces(ids)
        assert len(pieces) == len(ids) and "".join(pieces) == bpe.decode(ids)
    # a text whose characters are split across tokens: each piece is a whole-character prefix of the rest
    for text in ["日本の東京 café naïve 🐍🍎", "Zürich crème brûlée 東京"]:
        ids = t.encode(text)
        pieces = t.pieces(ids)
        assert "".join(pieces) == text
        for k in range(len(ids)):  # each prefix of pieces: the whole characters of the first k + 1 tokens' bytes
            assert b"".join(t.token_bytes[i] for i in ids[: k + 1]).decode("utf-8", "ignore") == "".join(
                pieces[: k + 1])
            if t.token_bytes[ids[k]] and not _valid(t.token_bytes[ids[k]]):
                split_seen += 1
    assert split_seen > 0  # the check above covered tokens holding part of a character


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_metaspace_byte_fallback(meta):
    """SentencePiece-style: "▁" is a space, `<0xNN>` one byte, a text's first token drops its "▁"; `decode_text`
    is the library's decode, `decode` the continuation's join."""
    t = TextTokenizer.from_hf(meta)
    assert t.decoding.metaspace_first == "▁" and t.token_bytes[meta.token_to_id("<0x0A>")] == b"\n"
    for text in SENTENCES[:100] + UNSEEN:
        ids = t.encode(text)
        assert t.decode_text(ids) == meta.decode(ids)
        assert "".join(t.pieces(ids)) == meta.decode(ids)
    ids = t.encode("hello world")
    assert t.decode(ids) == " hello world" and t.decode_text(ids) == "hello world"
    rng, checked = random.Random(1), 0
    for _ in range(300):
        ids = [rng.randrange(200 if rng.random() < 0.8 else t.vocab_size) for _ in range(rng.randint(1, 10))]
        assert "".join(t.pieces(ids)) == t.decode_text(ids)
        if _valid(b"".join(t.text_bytes(ids))):  # `tokenizers` spells each byte of an invalid run as U+FFFD
            assert t.decode_text(ids) == meta.decode(ids)
            checked += 1
    assert checked > 100


def test_no_decoder_joins_with_spaces():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "ĉ": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = TextTokenizer.from_hf(tok)
    assert t.decode_text([1, 2, 3]) == tok.decode([1, 2, 3]) == "a b ĉ" and t.decode([1, 2]) == " a b"


def test_llama2_style_sequence_with_strip(meta):
    """Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0) (Llama 2's tokenizer.json): the whole text's first
    space is stripped."""
    spec = json.loads(meta.to_str())
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    hf = Tokenizer.from_str(json.dumps(spec))
    t = TextTokenizer.from_bytes(json.dumps(spec).encode())
    rng, checked = random.Random(2), 0
    for _ in range(300):
        ids = [rng.randrange(200 if rng.random() < 0.8 else t.vocab_size) for _ in range(rng.randint(1, 8))]
        assert t.decode_text(ids) == "".join(t.pieces(ids))
        if _valid(b"".join(t.text_bytes(ids))):
            assert t.decode_text(ids) == hf.decode(ids)
            checked += 1
    assert checked > 100
    for text in SENTENCES[:50] + UNSEEN:
        assert t.decode_text(t.encode(text)) == hf.decode(hf.encode(text).ids) == text


@pytest.mark.parametrize("decoder", [decoders.WordPiece(), decoders.BPEDecoder(), decoders.CTC(),
                                     decoders.Sequence([decoders.Fuse(), decoders.Metaspace()])])
def test_decoders_not_reproduced_are_refused(bpe, decoder):
    hf = Tokenizer.from_str(bpe.to_str())
    hf.decoder = decoder
    with pytest.raises(ArtifactError) as e:
        TextTokenizer.from_bytes(hf.to_str().encode())
    assert e.value.param == "tokenizer"
    with pytest.raises(InputError) as e:
        TextTokenizer.from_hf(hf)
    assert e.value.param == "tokenizer"


def test_unreadable_file_is_refused(tmp_path):
    with pytest.raises(ArtifactError) as e:
        TextTokenizer.from_bytes(b'{"version": "1.0", "model": 3}')
    assert e.value.param == "tokenizer"
    with pytest.raises(InputError) as e:
        TextTokenizer.from_pretrained_dir(tmp_path)
    assert e.value.param == "tokenizer" and "tokenizer.json" in e.value.message


def test_vocab_for(bpe):
    v = vocab_for(bpe)
    assert len(v) == 300 and v.eos_id == 0 and v.preprocessing.tokenizer == "tokenizer.json"
    assert v.tokens[bpe.token_to_id("Ġthe")] == "Ġthe"
    padded = vocab_for(bpe, 310, EOS)
    assert padded.tokens[305] == "<|id:305|>" and padded.token_bytes[305] == b"" and len(padded.token_bytes) == 310
    assert padded.text([*padded.encode("café", add_eos=False), 305, 0]) == "café"
    with pytest.raises(InputError, match="V"):
        vocab_for(bpe, 299)
    with pytest.raises(InputError, match="eos"):
        vocab_for(bpe, None, "<nope>")
    assert tokenizer_files(bpe) == {"tokenizer.json": bpe.to_str().encode()}


def test_store_round_trip(tmp_path, bpe):
    path = make_tokenizer_hmm_store(tmp_path, "bpe", bpe, states=3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["preprocessing"] == {"lowercase": False, "unk": None, "eos": EOS, "add_eos": True,
                                         "tokenizer": "tokenizer.json"}
    data = (path / "tokenizer.json").read_bytes()
    assert manifest["files"]["tokenizer.json"] == hashlib.sha256(data).hexdigest()
    vocab = load_artifact(path).vocab
    assert vocab.tokenizer is not None and vocab.tokenizer.sha256 == manifest["files"]["tokenizer.json"]
    ids = vocab.encode("Zürich café 日本")
    assert ids[-1] == vocab.eos_id == 0 and ids[:-1] == bpe.encode("Zürich café 日本").ids
    assert vocab.text(ids) == "Zürich café 日本"
    prefix = vocab.encode("Zürich", add_eos=False)
    assert vocab.text(ids[len(prefix):-1], prefix) == " café 日本"


def _rewrite(path, fname: str, data: bytes) -> None:
    (path / fname).write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][fname] = hashlib.sha256(data).hexdigest()
    (path / "manifest.json").write_text(json.dumps(m))


def test_store_refusals(tmp_path, bpe):
    path = make_tokenizer_hmm_store(tmp_path, "m", bpe, states=2)
    good = (path / "tokenizer.json").read_bytes()
    (path / "tokenizer.json").write_bytes(good + b" ")  # changed under its manifest
    with pytest.raises(ArtifactError) as e:
        load_artifact(path)
    assert e.value.param == "tokenizer.json"
    _rewrite(path, "tokenizer.json", make_bpe_tokenizer(320).to_str().encode())  # larger than the model's V
    with pytest.raises(ArtifactError, match="exceeds") as e:
        load_artifact(path)
    assert e.value.param == "tokenizer"
    _rewrite(path, "tokenizer.json", good)
    load_artifact(path)
    m = json.loads((path / "manifest.json").read_text())
    m["preprocessing"]["eos"] = "<eos>"
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="eos") as e:
        load_artifact(path)
    assert e.value.param == "tokenizer"
    m["preprocessing"]["eos"] = EOS
    del m["files"]["tokenizer.json"]
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError) as e:
        load_artifact(path)
    assert e.value.param == "tokenizer.json"


def test_trained_here_is_deterministic():
    assert make_bpe_tokenizer().to_str() == make_bpe_tokenizer().to_str()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.to_str() == make_bpe_tokenizer().to_str()
