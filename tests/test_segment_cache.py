"""Piecewise tokenization with cached pieces must give exactly the ids of encoding the whole text,
and must switch itself off for tokenizers whose added tokens do not cut the text plainly."""

import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from duplexkv.model import segment_cache
from duplexkv.model.segment_cache import SegmentCache
from duplexkv.model.tokenizer import Tokenizer as DTokenizer

ALPHABET = ("abcdefghij klmnop  qrs\n\n\t  TUVW 0123456789 .,;:!?'\"()[]{}<>|/\\- éüß çà ñ"
            " 😀 中文 \u0301 e\u0301 ")


def random_text(rng: random.Random, n: int, specials: list[str]) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.01:
            out.append(rng.choice(specials))
        elif r < 0.02:
            out.append(rng.choice(specials)[: rng.randint(1, 5)])  # a broken special
        else:
            out.append(rng.choice(ALPHABET))
    return "".join(out)


def test_chat_prompts_encode_exactly_and_reuse_pieces(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(segment_cache, "MIN_CHARS", 64)
    monkeypatch.setattr(segment_cache, "MIN_PIECE_CHARS", 16)
    tok = DTokenizer.from_dir(tiny_model_dir)
    assert tok.segments.splittable
    fresh = SegmentCache(tok._tok)  # same settings, its own cache
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    rng = random.Random(0)
    messages: list[dict] = [{"role": "system", "content": random_text(rng, 300, specials)}]
    for turn in range(6):
        messages.append({"role": "user", "content": random_text(rng, rng.randint(50, 400),
                                                                specials)})
        text = tok.apply_chat_template(messages)
        want = tok._tok.encode(text).ids
        assert tok.encode(text) == want, f"turn {turn}"
        assert fresh.encode(text) == want
        messages.append({"role": "assistant", "content": random_text(rng, 120, specials)})
    assert tok.segments.hits > 0  # later turns reused the earlier messages' pieces
    for _ in range(200):  # arbitrary texts, specials anywhere (also at the ends)
        text = random_text(rng, rng.randint(0, 300), specials)
        assert fresh.encode(text) == tok._tok.encode(text).ids, repr(text)


def test_cache_stays_within_its_size(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(segment_cache, "MIN_CHARS", 0)
    monkeypatch.setattr(segment_cache, "MIN_PIECE_CHARS", 0)
    cache = SegmentCache(DTokenizer.from_dir(tiny_model_dir)._tok, max_chars=1000)
    rng = random.Random(1)
    for _ in range(100):
        cache.encode(random_text(rng, 300, ["<|im_end|>"]))
    assert 0 < cache._chars <= 1000
    assert cache._chars == sum(map(len, cache._cache))


def _metaspace_tokenizer(added: AddedToken) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"])
    tok.train_from_iterator([ALPHABET * 20, "hello world of tokens " * 50], trainer)
    tok.add_special_tokens([added])
    return tok


def test_tokenizers_that_do_not_cut_plainly_are_encoded_whole():
    # an added token that eats the whitespace before it: the cut is not where it appears
    lstrip = SegmentCache(_metaspace_tokenizer(AddedToken("<sep>", lstrip=True, special=True)))
    assert not lstrip.splittable
    # "prepend only to the first piece" changes the ids of later pieces: the probe sees it
    plain = _metaspace_tokenizer(AddedToken("<sep>", special=True))
    cache = SegmentCache(plain)
    text = ("hello world <sep>hello world " * 400)
    assert cache.encode(text) == plain.encode(text).ids
    assert not cache.splittable
    # ... and rightly so: encoding piece by piece would give other ids
    assert cache._pieces(text, cache=False) != plain.encode(text).ids
