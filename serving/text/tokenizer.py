"""Tokenizers behind one interface: encode, decode, streaming decode, chat templates.

Backends: a Hugging Face `tokenizer.json` (the `tokenizers` library), Meta's Llama 3
`tokenizer.model` (tiktoken with Llama 3's split pattern and 256 special tokens), and the GPT-2-style
byte-level BPE stored in a GGUF file (rebuilt as a `tokenizers` BPE). Every backend can give the raw
bytes of a token, so streaming decode works on bytes and never splits a UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizerModel

from serving.errors import UserError
from serving.text import chat_templates

# Llama 3's pre-tokenizer split pattern and special tokens (llama_models/llama3/tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
LLAMA3_NUM_SPECIALS = 256

# Special tokens that end a turn or a document in the model families we serve.
STOP_TOKENS = ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>")

# llama.cpp's GGUF pre-tokenizer names: the GPT-2 split, optionally with each digit on its own.
_GPT2_PRES = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


class TokenizerError(UserError):
    """A tokenizer that cannot be loaded or used."""


class Tokenizer(ABC):
    """Text <-> token ids for one model."""

    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised; no BOS added."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token's text for special tokens)."""

    @abstractmethod
    def is_special(self, token_id: int) -> bool: ...

    def token_id(self, text: str) -> int | None:
        """Id of a token whose text is exactly `text` (special tokens included), if any."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def encode_prompt(self, text: str) -> list[int]:
        """Ids for a raw completion prompt: BOS first when the model expects it."""
        ids = self.encode(text)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        raw = b"".join(self.token_bytes(i) for i in ids if not (skip_special and self.is_special(int(i))))
        return raw.decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render chat messages ({"role", "content"}) to the prompt text the model was tuned on."""
        return chat_templates.render(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_id),
            eos_token=self._special_text(self.eos_ids[0] if self.eos_ids else None),
        )

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Ids of a chat prompt, ending where the assistant's reply begins."""
        return self.encode(self.apply_chat_template(messages))

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _find_stop_ids(self) -> tuple[int, ...]:
        found = (self.token_id(t) for t in STOP_TOKENS)
        return tuple(sorted({i for i in found if i is not None and self.is_special(i)}))


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas; a partial UTF-8 character is held back."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is left at the end of the stream (a dangling partial character as U+FFFD)."""
        return self._utf8.decode(b"", final=True)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (tokenizer.json, or rebuilt from GGUF metadata)."""

    def __init__(
        self,
        model: HFTokenizerModel,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        add_bos: bool | None = None,
    ):
        self._model = model
        self._special = {t.content for t in model.get_added_tokens_decoder().values() if t.special}
        self._special_ids = {model.token_to_id(t) for t in self._special}
        decoder = json.loads(model.to_str()).get("decoder") or {}
        self._byte_level = "ByteLevel" in json.dumps(decoder)
        self.bos_id = model.token_to_id(bos_token) if bos_token else self._detect_bos()
        self.add_bos = self._detect_bos() is not None if add_bos is None else add_bos
        eos = [model.token_to_id(t) for t in eos_tokens]
        self.eos_ids = tuple(sorted({i for i in eos if i is not None} | set(self._find_stop_ids())))
        self.chat_template = chat_templates.resolve(chat_template, self)

    @classmethod
    def from_dir(cls, path: Path) -> HFTokenizer:
        """tokenizer.json plus tokenizer_config.json / generation_config.json when present."""
        model = _read_tokenizer_json(path / "tokenizer.json")
        settings = _read_json(path / "tokenizer_config.json")
        template = settings.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos = [_token_text(settings.get("eos_token"))]
        generation = _read_json(path / "generation_config.json")
        eos_ids = generation.get("eos_token_id", [])
        for i in eos_ids if isinstance(eos_ids, list) else [eos_ids]:
            eos.append(model.id_to_token(int(i)))
        return cls(
            model,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(settings.get("bos_token")),
            eos_tokens=[t for t in eos if t],
            add_bos=settings.get("add_bos_token"),
        )

    @property
    def vocab_size(self) -> int:
        return self._model.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text, add_special_tokens=False).ids

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._model.id_to_token(token_id)
        if piece is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        if piece in self._special or not self._byte_level:
            return self._model.decode([token_id], skip_special_tokens=False).encode("utf-8")
        table = _byte_decoder()
        try:
            return bytes(table[c] for c in piece)
        except KeyError:  # an added, non-byte-level token
            return piece.encode("utf-8")

    def _detect_bos(self) -> int | None:
        with_specials = self._model.encode("a", add_special_tokens=True).ids
        without = self._model.encode("a", add_special_tokens=False).ids
        if len(with_specials) > len(without) and with_specials[0] != without[0]:
            return with_specials[0]
        return None


class TiktokenTokenizer(Tokenizer):
    """Meta's Llama 3 `tokenizer.model`: base64 ranks for tiktoken, plus 256 special tokens."""

    def __init__(self, path: Path, chat_template: str | None = None):
        try:
            ranks = load_tiktoken_bpe(str(path))
        except (ValueError, OSError) as exc:
            raise TokenizerError(f"{path}: not a tiktoken BPE file: {exc}") from None
        reserved = [
            f"<|reserved_special_token_{i}|>"
            for i in range(2, 2 + LLAMA3_NUM_SPECIALS - len(LLAMA3_NAMED_SPECIALS))
        ]
        specials = {t: len(ranks) + i for i, t in enumerate([*LLAMA3_NAMED_SPECIALS, *reserved])}
        self._encoding = tiktoken.Encoding(
            name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self._special_ids = set(specials.values())
        self.bos_id = specials["<|begin_of_text|>"]
        self.add_bos = True
        self.eos_ids = self._find_stop_ids()
        self.chat_template = chat_templates.resolve(chat_template, self)

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._encoding.decode_single_token_bytes(token_id)
        except KeyError:
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary ({self.vocab_size})"
            ) from None


def tokenizer_from_gguf(data) -> HFTokenizer:
    """Rebuild the byte-level BPE stored in GGUF metadata (a `serving.checkpoints.gguf_file.GGUFTokenizerData`)."""
    if data.model != "gpt2":
        raise TokenizerError(f"GGUF tokenizer model {data.model!r} is not supported (gpt2 byte-level BPE)")
    vocab = {token: i for i, token in enumerate(data.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges]
    model = HFTokenizerModel(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if data.pre in _DIGIT_SPLIT_PRES:
        model.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif data.pre in _GPT2_PRES:
        model.pre_tokenizer = byte_level
    elif data.pre in ("llama-bpe", "llama3"):
        model.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise TokenizerError(f"GGUF pre-tokenizer {data.pre!r} is not supported")
    model.decoder = decoders.ByteLevel()
    control, user_defined = 3, 4  # llama.cpp token types
    model.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(data.tokens, data.token_types, strict=False)
            if k == control
        ]
    )
    model.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t, k in zip(data.tokens, data.token_types, strict=False)
            if k == user_defined
        ]
    )
    token = data.tokens
    return HFTokenizer(
        model,
        chat_template=data.chat_template,
        bos_token=token[data.bos_id] if data.bos_id is not None else None,
        eos_tokens=[token[data.eos_id]] if data.eos_id is not None else [],
        add_bos=data.add_bos,
    )


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face directory, or a standalone tokenizer.json / tokenizer.model."""
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer.from_dir(path)
        if (path / "tokenizer.model").is_file():
            return TiktokenTokenizer(
                path / "tokenizer.model", _read_json(path / "tokenizer_config.json").get("chat_template")
            )
        raise TokenizerError(f"{path}: no tokenizer.json or tokenizer.model")
    if path.name.endswith(".json"):
        return HFTokenizer(_read_tokenizer_json(path))
    if path.is_file():
        return TiktokenTokenizer(path)
    raise TokenizerError(f"tokenizer not found: {path}")


def _read_tokenizer_json(path: Path) -> HFTokenizerModel:
    """A tokenizer.json; one the tokenizers library cannot read is a TokenizerError naming it."""
    try:
        return HFTokenizerModel.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception for a malformed file
        raise TokenizerError(f"{path}: not a tokenizer the tokenizers library reads: {exc}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON: {exc}") from None


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None


__all__ = [
    "HFTokenizer",
    "IncrementalDecoder",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_from_gguf",
]
