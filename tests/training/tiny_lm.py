"""A tiny GPT-2 and its byte-level BPE tokenizer, trained here in seconds on sentences of a small template grammar
and saved as `save_pretrained` writes them: the LM `latentlm distill` is tested on (no model hub here)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

EOS = "<|endoftext|>"
ADJ = ["red", "big", "small", "old", "quiet", "green"]
NOUN = ["dog", "cat", "apple", "tree", "boat", "bird"]
VERB = ["sleeps", "waits", "sings", "falls"]
PLACE = ["river", "hill", "road"]


def sentences() -> list[str]:
    """216 x 2 sentences: 'the ADJ NOUN VERB near the PLACE .' and a shorter 'a NOUN VERB .'."""
    long = [f"the {a} {n} {v} near the {p} ." for a, n, v, p in itertools.product(ADJ, NOUN, VERB, PLACE)]
    short = [f"a {n} {v} ." for n, v in itertools.product(NOUN, VERB)]
    return long + short * 9


def train_tokenizer(texts: list[str], vocab_size: int = 300):
    """A byte-level BPE (`tokenizers`) trained on `texts`, with `<|endoftext|>` as id 0, wrapped as
    `PreTrainedTokenizerFast` (BOS = EOS = `<|endoftext|>`, as GPT-2's)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)


def make_lm(directory: Path, *, steps: int = 60, seed: int = 0) -> Path:
    """Train a 1-layer GPT-2 (n_embd 32) on `sentences()` framed by EOS for `steps` Adam steps and save it with its
    tokenizer into `directory`. A few seconds on a CPU."""
    import transformers

    torch.manual_seed(seed)
    texts = sentences()
    tok = train_tokenizer(texts)
    eos = tok.eos_token_id
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=32, vocab_size=len(tok),
                                     bos_token_id=eos, eos_token_id=eos)
    model = transformers.GPT2LMHeadModel(config)
    seqs = [[eos, *tok(t)["input_ids"], eos] for t in texts]
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [eos] * (T - len(s)) for s in seqs])
    labels = torch.tensor([s + [-100] * (T - len(s)) for s in seqs])
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only waits for a second thread (and the CPU is shared)
    for _ in range(steps):
        idx = torch.randint(len(ids), (32,))
        loss = model(input_ids=ids[idx], labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
