"""Tokenizer wrapper over Hugging Face `tokenizers` (tokenizer.json), with streaming detokenization.

Streaming text must never emit half a UTF-8 character: a byte-level BPE token can end inside a
multi-byte character, which decodes to U+FFFD until the next token completes it.  ``IncrementalDecoder``
holds such a tail back, so concatenating its deltas equals decoding the whole sequence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from dspark_jax.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        *,
        eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        bos_token_id: int | None = None,
    ):
        self._tok = tok
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        # Prepended to every encoded text when tokenizer_config.json asks for it (add_bos_token):
        # a model trained on bos-prefixed documents reads an unprefixed prompt as mid-document.
        self.bos_token_id = bos_token_id

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.exists():
            raise CheckpointError(f"{folder}: {TOKENIZER_FILE} is missing")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise CheckpointError(f"{path}: cannot parse tokenizer ({e})") from None
        eos: list[int] = []
        template = None
        bos_id = None
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                tcfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
            template = tcfg.get("chat_template")
            eos_tok = tcfg.get("eos_token")
            if isinstance(eos_tok, dict):
                eos_tok = eos_tok.get("content")
            if isinstance(eos_tok, str) and tok.token_to_id(eos_tok) is not None:
                eos.append(tok.token_to_id(eos_tok))
            bos_tok = tcfg.get("bos_token")
            if isinstance(bos_tok, dict):
                bos_tok = bos_tok.get("content")
            if tcfg.get("add_bos_token") and isinstance(bos_tok, str):
                bos_id = tok.token_to_id(bos_tok)
                if bos_id is None:
                    raise CheckpointError(f"{cfg_path}: add_bos_token is set but {bos_tok!r} is not in the vocabulary")
        return cls(tok, eos_token_ids=tuple(eos), chat_template=template, bos_token_id=bos_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized
        # on a server's worker thread then stalls no other thread.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_token_id, *ids] if self.bos_token_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def token_bytes(self) -> dict[int, bytes]:
        """The bytes each token id stands for in decoded text (special tokens left out): a
        byte-level BPE token spells its bytes as printable characters (GPT-2's map), a
        SentencePiece one writes spaces as U+2581 and unknown bytes as <0xNN>."""
        spec = json.loads(self._tok.to_str())
        decoders = spec.get("decoder") or {}
        kinds = {d.get("type") for d in decoders.get("decoders", [decoders])}
        byte_level = "ByteLevel" in kinds
        unmap = {c: b for b, c in _gpt2_bytes().items()}
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        added = {t["id"] for t in spec.get("added_tokens", [])}
        out = {}
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in special:
                continue
            if i in added:  # added tokens are written as they read
                out[i] = token.encode()
            elif byte_level:
                out[i] = bytes(unmap[c] for c in token) if all(c in unmap for c in token) else token.encode()
            elif (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)) and "ByteFallback" in kinds:
                out[i] = bytes([int(m.group(1), 16)])
            else:
                out[i] = token.replace("\u2581", " ").encode()
        return out

    @property
    def eos_token(self) -> str | None:
        """The first end-of-sequence token's string (chat templates print it)."""
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas that are always whole characters.

    Decodes only a short window of recent tokens each time (prefix_offset..), so cost per token
    stays constant instead of growing with the output length.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, token_ids) -> str:
        self.ids.extend(int(t) for t in token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (a dangling partial character decodes as U+FFFD)."""
        full = self.tok.decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
