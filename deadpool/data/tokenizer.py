"""The tokenizers ``prepare`` writes, both Hugging Face ``tokenizers`` byte-level tokenizers
(so ``tokenizer.json`` loads in ``transformers`` whichever was used).

``byte``: ids 0..255 are the UTF-8 bytes themselves (a byte-level BPE with no merges, whose
vocabulary maps each byte's printable stand-in character to the byte's value), 256 is the
end-of-document token. ``bpe``: a byte-level BPE trained offline on the input (GPT-2's scheme:
the 256 byte characters as the initial alphabet, merges learned up to ``vocab_size``, the
end-of-document token first, id 0). Or a user's own ``tokenizer.json`` (``load_tokenizer``),
kept byte for byte with its special tokens: ``Specials`` says how its documents are framed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


# -- a user's tokenizer.json ----------------------------------------------------------------------
# end-of-document tokens of the common families, tried in order when nothing names one
KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


@dataclass(frozen=True)
class Specials:
    """How a document is framed in the token stream: ``prefix + ids + suffix``, then the
    end-of-document token unless the suffix already ends with it. ``prefix``/``suffix`` are
    what the tokenizer's own post-processor adds (``encode(text)`` with special tokens), so a
    document's tokens are exactly the tokenizer's encoding of it (e.g. Llama 3: BOS first)."""
    eos_id: int
    eos_token: str
    bos_token: str | None
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def frame(self, ids: list[int], first: bool, last: bool) -> list[int]:
        """A piece's tokens with the document's framing (its first / last piece)."""
        out = list(self.prefix) + ids if first else ids
        if last:
            out += self.suffix
            if not out or out[-1] != self.eos_id:
                out.append(self.eos_id)
        return out


def _config_token(config: dict, key: str) -> str | None:
    v = config.get(key)
    return v.get("content") if isinstance(v, dict) else v


def specials(tok: Tokenizer, eos_token: str | None = None, config: dict | None = None) -> Specials:
    """The framing of ``tok``'s documents. The end-of-document token: ``eos_token``, else the
    ``eos_token`` of a ``tokenizer_config.json`` beside the file (``config``), else the first
    of ``KNOWN_EOS`` the vocabulary has; ``ValueError`` naming the choices if none is found."""
    config = config or {}
    name = eos_token or _config_token(config, "eos_token")
    if name is None:
        name = next((t for t in KNOWN_EOS if tok.token_to_id(t) is not None), None)
    if name is None:
        raise ValueError("the tokenizer names no end-of-document token (no tokenizer_config.json "
                         f"beside it, none of {', '.join(KNOWN_EOS)}): give --eos-token")
    eos = tok.token_to_id(name)
    if eos is None:
        raise ValueError(f"end-of-document token {name!r} is not in the tokenizer's vocabulary")
    probe = "a"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    i = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
    prefix, suffix = tuple(full[:i]), tuple(full[i + len(bare):])
    bos = _config_token(config, "bos_token")
    if bos is None and prefix:
        bos = tok.id_to_token(prefix[0])
    return Specials(eos, name, bos, prefix, suffix)


def load_tokenizer(path, eos_token: str | None = None) -> tuple[Tokenizer, Specials, Path]:
    """A Hugging Face ``tokenizer.json`` (or a directory holding one, with its
    ``tokenizer_config.json`` if any); returns it, its framing and the file."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer {path}: no such file (a Hugging Face tokenizer.json, or "
                         "bpe / byte)")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({e})") from None
    config_file = p.parent / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return tok, specials(tok, eos_token, config), p
