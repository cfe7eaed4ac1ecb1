"""Tokenizers: the byte-level default and a Hugging Face `tokenizer.json` (the `tokenizers` library).

Both expose the same small interface (`Tokenizer`): encode a batch of documents, the
end-of-text id that joins documents, the vocabulary size, and an identity - a name, the
SHA-256 of the tokenizer's file and one of each part that decides the ids (`PARTS`) - that a
prepared data directory records so a run can refuse shards made by another tokenizer than its
model's. Tokenizers are compared by what they do: the same vocabulary, merges, normaliser,
pre-tokeniser and special tokens are the same tokenizer, whatever else the file holds (a
post-processor, which threefold never applies - it encodes without special tokens -, a
decoder, padding, the file's formatting); the first part that differs is named.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Protocol

from ..errors import UserError

TOKENIZER_FILE = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"
# end-of-text tokens of common model families, tried in this order when tokenizer_config.json names none
_EOT_CANDIDATES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


@dataclass(frozen=True)
class TokenizerIdentity:
    kind: str  # "byte" | "hf"
    name: str  # the directory's name for "hf"
    sha256: str  # of tokenizer.json ("byte": of a fixed description)
    vocab_size: int
    eot_id: int
    parts: dict[str, str] = field(default_factory=dict)  # PARTS -> SHA-256 of its canonical JSON ({}: unknown)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "TokenizerIdentity":
        return TokenizerIdentity(str(d["kind"]), str(d["name"]), str(d["sha256"]), int(d["vocab_size"]),
                                 int(d["eot_id"]), {str(k): str(v) for k, v in (d.get("parts") or {}).items()})

    def first_difference(self, other: "TokenizerIdentity") -> str | None:
        """The first part in which the two tokenize differently, or None when they tokenize alike.
        Identities recorded without parts (older data) are compared by their file's hash."""
        if self.kind != other.kind:
            return "kind"
        if not (self.parts and other.parts):
            return None if self.sha256 == other.sha256 else "tokenizer.json"
        return next((part for part in PARTS if self.parts.get(part) != other.parts.get(part)), None)

    def describe(self) -> str:
        return f"{self.kind} tokenizer '{self.name}' (vocab {self.vocab_size}, sha256 {self.sha256[:12]})"


PARTS = ("vocabulary", "merges", "normalizer", "pre_tokenizer", "special tokens", "end-of-text")


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokenizer_parts(definition: dict, eot_id: int) -> dict[str, str]:
    """The SHA-256 of each part of a tokenizer.json that decides the ids of a text."""
    model = dict(definition.get("model") or {})
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.pop("merges", None) or []]
    vocab = model.pop("vocab", None)
    added = sorted(((t["id"], t["content"], bool(t.get("special"))) for t in definition.get("added_tokens") or []))
    return {"vocabulary": _digest([vocab, model]), "merges": _digest(merges),
            "normalizer": _digest(definition.get("normalizer")), "pre_tokenizer": _digest(definition.get("pre_tokenizer")),
            "special tokens": _digest(added), "end-of-text": _digest(eot_id)}


class Tokenizer(Protocol):
    identity: TokenizerIdentity

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) and end-of-text = 256: vocabulary 257."""

    def __init__(self):
        sha = hashlib.sha256(b"threefold byte-level tokenizer: ids 0-255 are bytes, 256 is end-of-text").hexdigest()
        self.identity = TokenizerIdentity("byte", "byte", sha, 257, 256)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class HFTokenizer:
    """The `tokenizer.json` of a Hugging Face model directory, through the `tokenizers` library."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as RustTokenizer

        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise UserError(f"tokenizer: '{directory}' has no {TOKENIZER_FILE}; give a Hugging Face model "
                            "directory or train one with `threefold data tokenizer train`")
        raw = path.read_bytes()
        try:
            self._tok = RustTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise UserError(f"tokenizer: '{path}' is not a valid tokenizer.json ({str(e).splitlines()[0]})") from None
        eot = _end_of_text(self._tok, directory)
        self.identity = TokenizerIdentity("hf", directory.resolve().name, hashlib.sha256(raw).hexdigest(),
                                          self._tok.get_vocab_size(with_added_tokens=True), eot,
                                          tokenizer_parts(json.loads(raw), eot))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]


def _end_of_text(tok, directory: Path) -> int:
    names = list(_EOT_CANDIDATES)
    config = directory / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise UserError(f"tokenizer: '{directory / TOKENIZER_FILE}' has no end-of-text token (tried "
                    f"{', '.join(names)}); add one, e.g. train with `threefold data tokenizer train`")


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The tokenizer of `directory` (a dir with tokenizer.json), or the byte-level one for None / "byte"."""
    if directory is None or str(directory) == "byte":
        return ByteTokenizer()
    return HFTokenizer(Path(directory))


def check_tokenizer_match(data: TokenizerIdentity, model: TokenizerIdentity, data_dir: str | Path) -> None:
    """Refuse shards made by a tokenizer that tokenizes differently from the model's: one line naming both
    and the first part that differs."""
    differs = data.first_difference(model)
    if differs is not None:
        raise UserError(f"data: '{data_dir}' was tokenized by the {data.describe()}, but the model uses the "
                        f"{model.describe()}, whose {differs} differs; prepare the data with the model's tokenizer")


def train_bpe(texts: Iterable[list[str]], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE tokenizer on batches of documents; writes out/tokenizer.json (+ tokenizer_config.json)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT}) + "\n")
    return out / TOKENIZER_FILE
