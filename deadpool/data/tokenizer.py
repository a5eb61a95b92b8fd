"""The tokenizers ``prepare`` writes, both Hugging Face ``tokenizers`` byte-level tokenizers
(so ``tokenizer.json`` loads in ``transformers`` whichever was used).

``byte``: ids 0..255 are the UTF-8 bytes themselves (a byte-level BPE with no merges, whose
vocabulary maps each byte's printable stand-in character to the byte's value), 256 is the
end-of-document token. ``bpe``: a byte-level BPE trained offline on the input (GPT-2's scheme:
the 256 byte characters as the initial alphabet, merges learned up to ``vocab_size``, the
end-of-document token first, id 0).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # the 256 byte characters + the end-of-document token


def byte_chars() -> dict[int, str]:
    """Byte -> the printable character byte-level tokenizers stand it in with: printable Latin-1
    bytes are themselves, the others (controls, space, ...) take code points 256, 257, ... in
    byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer() -> Tokenizer:
    vocab = {ch: b for b, ch in byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


def train_bpe(texts, vocab_size: int, show_progress: bool = False, length: int | None = None) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens learned from the iterable ``texts``."""
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"--vocab-size {vocab_size} is too small for a byte-level BPE "
                         f"(at least {MIN_BPE_VOCAB}: 256 bytes + the end-of-document token)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    tok.train_from_iterator(texts, trainer, length=length)
    return tok
