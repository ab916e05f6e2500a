"""Tokenizers: text <-> token ids, built offline from a GGUF file, a tokenizer.json, or bytes.

One class, `Tokenizer`, wraps a `tokenizers.Tokenizer` (the Rust library behind Hugging Face's fast
tokenizers) so that every source behaves the same:

- `from_gguf_fields`: the byte-level BPE stored in a GGUF file's metadata (SmolLM2). The GGUF keeps
  vocabulary, merges and token types but not the pre-tokenizer; SmolLM2 splits every digit on its own
  before GPT-2's byte-level regex (its tokenizer.json on the hub; llama.cpp's "smollm" pre-type), so we
  rebuild that: Digits(individual_digits=True), then ByteLevel(add_prefix_space=False, use_regex=True).
- `from_dir`: a Hugging Face tokenizer.json (+ tokenizer_config.json / config.json for bos/eos).
- `byte_level`: 256 byte tokens plus three specials, for the random "tiny" preset.

`encode` never adds BOS/EOS: callers that want them add the ids themselves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from memlm.errors import MemlmError

# GGUF token types (llama.cpp's llama_token_type): 3 CONTROL, 4 USER_DEFINED. Both are whole tokens
# that BPE must never split; SmolLM2's tokenizer.json marks its 17 control tokens special.
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
"""Specials of the byte tokenizer, ids 256, 257, 258."""


def _canonical(json_text: str) -> str:
    """Key-sorted, whitespace-free JSON, so equal tokenizers hash equally whatever wrote them."""
    return json.dumps(json.loads(json_text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Tokenizer:
    """Text <-> ids. Wraps a `tokenizers.Tokenizer`; `bos_id`/`eos_id` come from the source's metadata."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_id: int | None, eos_id: int | None) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        for name, i in (("bos_id", bos_id), ("eos_id", eos_id)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise ValueError(f"{name} {i} outside the vocabulary of {self.vocab_size} tokens")
        self._fingerprint: str | None = None

    # -- the interface everyone uses -------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS or EOS is added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts at once (the Rust side runs them in parallel)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included (so encode/decode round-trips them)."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    @property
    def fingerprint(self) -> str:
        """sha256 hex of the canonical tokenizer JSON plus bos/eos ids: equal iff text maps to ids equally."""
        if self._fingerprint is None:
            h = hashlib.sha256(_canonical(self.to_json()).encode("utf-8"))
            h.update(f"\nbos_id={self.bos_id}\neos_id={self.eos_id}".encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def to_json(self) -> str:
        """The Hugging Face tokenizer.json text (bos/eos travel in tokenizer_config.json, see `save`)."""
        return self.backend.to_str()

    @classmethod
    def from_json(cls, text: str, bos_id: int | None = None, eos_id: int | None = None) -> "Tokenizer":
        """Inverse of `to_json` (bos/eos are not part of tokenizer.json; pass them back in)."""
        return cls(tokenizers.Tokenizer.from_str(text), bos_id, eos_id)

    # -- files -----------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (bos/eos by name, as Hugging Face does)."""
        directory = Path(directory)
        (directory / "tokenizer.json").write_text(self.to_json(), encoding="utf-8")
        names = {
            "bos_token": self.id_to_token(self.bos_id) if self.bos_id is not None else None,
            "eos_token": self.id_to_token(self.eos_id) if self.eos_id is not None else None,
            "add_bos_token": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(names, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """Load a Hugging Face tokenizer.json; bos/eos from tokenizer_config.json, else config.json ids."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise MemlmError(f"{directory} has no tokenizer.json; memlm reads only fast (JSON) tokenizers")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
            raise MemlmError(f"cannot read {path}: {e}") from e
        ids: dict[str, int | None] = {"bos": None, "eos": None}
        tok_cfg = _read_json(directory / "tokenizer_config.json")
        for key in ids:
            name = tok_cfg.get(f"{key}_token")
            if isinstance(name, dict):  # older files store an AddedToken dict
                name = name.get("content")
            if isinstance(name, str):
                ids[key] = backend.token_to_id(name)
        model_cfg = _read_json(directory / "config.json")
        for key in ids:
            value = model_cfg.get(f"{key}_token_id")
            if ids[key] is None and isinstance(value, int):
                ids[key] = value
        return cls(backend, ids["bos"], ids["eos"])

    # -- builders --------------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
        """Byte-level BPE from GGUF metadata (`tokenizer.ggml.*` keys as plain Python values)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise MemlmError(f"GGUF tokenizer model {kind!r} is not supported; memlm reads byte-level BPE ('gpt2')")
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = fields.get("tokenizer.ggml.pre")
        if pre not in (None, "smollm", "gpt-2", "gpt2", "default"):
            raise MemlmError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt-2)")
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre in (None, "smollm"):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, kind in zip(tokens, types) if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
        # Added tokens that are already in the vocabulary keep their ids (no growth).
        backend.add_special_tokens(specials)
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise MemlmError("GGUF tokenizer: special tokens are missing from the vocabulary; the file is malformed")
        return cls(backend, fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id"))

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        """Ids 0..255 are the raw UTF-8 bytes, 256..258 are BYTE_SPECIALS (bos, eos, pad)."""
        # ByteLevel spells each byte as one printable character (GPT-2's bytes_to_unicode);
        # listing them in byte order makes id == byte value. No merges: every byte is one token.
        assert set(pre_tokenizers.ByteLevel.alphabet()) == set(_UNICODE_TO_BYTE)
        vocab = dict(sorted(_UNICODE_TO_BYTE.items(), key=lambda kv: kv[1]))
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
        return cls(backend, bos_id=256, eos_id=257)


def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py): printable Latin-1 bytes stand for
    # themselves, the other 68 bytes are mapped, in byte order, to chr(256), chr(257), ...
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in printable):
        table[chr(256 + n)] = b
    return table


_UNICODE_TO_BYTE = _unicode_to_byte()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise MemlmError(f"{path} is not valid JSON ({e}); restore or delete it") from e
    return data if isinstance(data, dict) else {}


def document_boundary(tokenizer: "Tokenizer") -> int:
    """The token that precedes every document or scored sequence, the one rule for every path (eval,
    train, datastore build, serving, benchmarks): <|endoftext|> when the vocabulary has it, else BOS,
    else EOS; a MemlmError when the tokenizer has none of them.

    SmolLM2's pretraining data joins documents with <|endoftext|> (id 0); the Instruct GGUF's BOS is
    the chat token <|im_start|>. Measured on a 91-token English paragraph: perplexity 15.06 after
    <|endoftext|>, 17.82 after <|im_start|>.
    """
    for candidate in (tokenizer.token_to_id("<|endoftext|>"), tokenizer.bos_id, tokenizer.eos_id):
        if candidate is not None:
            return candidate
    raise MemlmError("the tokenizer has neither <|endoftext|>, BOS nor EOS to mark document starts")
