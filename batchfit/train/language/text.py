"""Language-modelling corpora, and a small GPT-style decoder to train on one.

`python_stdlib` is a byte-level corpus that every machine has offline: the source of the
Python standard library, as (input, next byte) pairs for the GPT (task=language_model).
`text_corpus` reads local text or JSONL files (or that same stdlib source), tokenised by a
Hugging Face tokenizer or at byte level, packed into full sequences in Hugging Face's
convention for causal LMs (task=causal_lm).

The corpus is the standard library's top-level modules (`*.py` directly in the stdlib
directory, names not starting with "_"), in sorted order, concatenated until `max_bytes`.
It is deterministic for a given Python version (another version ships other source, so its
figures are not comparable); `corpus_sha256` in the data's info says which text a run saw.
The last `val_fraction` of the bytes is held out for validation.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from batchfit.train.data import Datasets

VOCAB_SIZE = 256  # bytes


def stdlib_source(max_bytes: int | None) -> bytes:
    """The first `max_bytes` of the standard library's top-level modules' source (None: all
    of it)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        if path.name.startswith("_"):
            continue
        text = path.read_bytes()
        parts.append(text)
        size += len(text)
        if max_bytes is not None and size >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    if max_bytes is not None and len(corpus) < max_bytes:
        raise ValueError(
            f"data.max_bytes={max_bytes} but the standard library at {root} has only "
            f"{len(corpus)} bytes of top-level source; lower data.max_bytes"
        )
    return corpus


def _more_text(max_bytes: int | None, otherwise: str) -> str:
    """The fix for a corpus too short: more of it where data.max_bytes caps it."""
    if max_bytes is None:  # all of it was read already
        return f"data.max_bytes=null reads all of it: {otherwise}, or add text (data.paths)"
    return f"raise data.max_bytes (or null: all of it) or {otherwise}"


def _tokenizer_problem(tokenizer: str, error: Exception) -> str:
    """What is wrong with data.tokenizer, in batchfit's words: Hugging Face's for a path
    that does not exist ("Repo id must be in the form...") speaks of the hub."""
    fix = (
        "give a local tokenizer directory (one AutoTokenizer.save_pretrained wrote, with "
        "tokenizer.json or tokenizer_config.json), or data.tokenizer=null for bytes"
    )
    if not Path(tokenizer).expanduser().exists():
        return (
            f"data.tokenizer={tokenizer!r}: no such directory here, nor a model of that name in "
            f"the local Hugging Face cache (batchfit loads tokenizers offline); {fix}"
        )
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"data.tokenizer={tokenizer!r} cannot be loaded as a tokenizer ({first}); {fix}"


class ByteChunks(Dataset):
    """Non-overlapping windows of `seq_len` bytes: sample i is the dict
    {input_ids: bytes[i*T : i*T+T], labels: bytes[i*T+1 : i*T+T+1]} (int64, shape (T,))."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


def python_stdlib(seq_len: int = 128, max_bytes: int | None = 400_000, val_fraction: float = 0.1):
    """The stdlib corpus as train and validation `ByteChunks`, with `vocab_size` (256) and
    `block_size` (seq_len) for the model builder."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"data.seq_len must be an integer >= 1, got {seq_len!r}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction!r}")
    corpus = stdlib_source(max_bytes)
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    num_val = int(len(data) * val_fraction)
    train, val = ByteChunks(data[:-num_val], seq_len), ByteChunks(data[-num_val:], seq_len)
    if len(val) == 0:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than the {num_val} validation bytes; "
            f"{_more_text(max_bytes, 'raise data.val_fraction')}"
        )
    return Datasets(
        train,
        val,
        vocab_size=VOCAB_SIZE,
        block_size=seq_len,
        corpus_sha256=hashlib.sha256(corpus).hexdigest(),
    )


class PackedSequences(Dataset):
    """Non-overlapping windows of `seq_len` tokens of one packed token stream: sample i is
    {input_ids: tokens[i*T : i*T+T], labels: the same} (int64, shape (T,)); the task shifts
    the labels (train.tasks.CausalLM). A remainder shorter than T is dropped."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = self.tokens[i * self.seq_len : (i + 1) * self.seq_len].long()
        return {"input_ids": window, "labels": window}


def _jsonl_texts(path: Path, text_key: str) -> Iterator[str]:
    """The `text_key` field of each line of a JSONL file; a line that is not a JSON object
    with that field is a ValueError naming `path:line`. Lines are split at newlines only:
    str.splitlines() also splits at U+2028 and other separators that JSON strings may hold
    raw, and cut such a record in two and numbered every line after it wrongly."""
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"data.paths: {path} is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    example = f'{{"{text_key}": "..."}}'
    for number, line in enumerate(content.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"data.paths: {path}:{number}:{error.colno} is not valid JSON ({error.msg}); "
                f"a JSONL file holds one JSON object a line, e.g. {example}"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(
                f"data.paths: {path}:{number} holds a JSON {_json_type(record)}, not an "
                f"object; a JSONL file holds one JSON object a line, e.g. {example}"
            )
        if text_key not in record:
            raise ValueError(
                f"{path}:{number} has no {text_key!r} field (it has "
                f"{sorted(record)}); set data.text_key"
            )
        yield str(record[text_key])


def _json_type(value: object) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


def _documents(paths: Sequence[str], text_key: str, max_bytes: int | None) -> Iterator[str]:
    """The documents of `paths` (files or glob patterns, in the order given, each pattern's
    matches sorted): a JSONL file's lines (their `text_key` field), any other file whole."""
    files: list[Path] = []
    for pattern in paths:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise FileNotFoundError(f"data.paths: {pattern!r} matches no file")
        files += [Path(m) for m in matches if Path(m).is_file()]
    read = 0
    for path in files:
        if path.suffix == ".jsonl":
            texts = list(_jsonl_texts(path, text_key))
        else:
            texts = [path.read_text(encoding="utf-8", errors="replace")]
        for text in texts:
            yield text
            read += len(text.encode())
            if max_bytes is not None and read >= max_bytes:
                return


def text_corpus(
    paths: str | Sequence[str] | None = None,
    tokenizer: str | None = None,
    seq_len: int = 128,
    max_bytes: int | None = 400_000,
    val_fraction: float = 0.1,
    text_key: str = "text",
) -> Datasets:
    """Local text as train and validation `PackedSequences` of `seq_len` tokens.

    `paths`: text files and JSONL files (one document per line, its `text_key` field), or
    glob patterns; None reads the Python standard library's source (`python_stdlib`'s
    text). Reading stops after `max_bytes` of text (None: all of it). `tokenizer`: a local
    Hugging Face tokenizer directory (AutoTokenizer, local files only), whose EOS token
    ends each document; None tokenises at byte level (UTF-8 bytes, vocab_size 256).
    Documents are packed: concatenated into one stream and cut into full sequences, so no
    token is padding and a sequence may span documents (attention is not masked at their
    boundaries). The last `val_fraction` of the tokens is held out."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"data.seq_len must be an integer >= 2, got {seq_len!r}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction!r}")
    if paths is None:
        texts = [stdlib_source(max_bytes).decode("utf-8", errors="replace")]
    else:
        texts = list(_documents([paths] if isinstance(paths, str) else paths, text_key, max_bytes))
    if tokenizer is None:
        ids = [list(text.encode("utf-8")) for text in texts]
        vocab_size, name = VOCAB_SIZE, "bytes"
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        except (OSError, ValueError) as error:  # not there, or not a tokenizer
            raise FileNotFoundError(_tokenizer_problem(tokenizer, error)) from None
        eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
        ids = [tok(text, add_special_tokens=False)["input_ids"] + eos for text in texts]
        vocab_size, name = len(tok), str(tokenizer)
    tokens = torch.tensor([i for doc in ids for i in doc], dtype=torch.int32)
    num_val = int(len(tokens) * val_fraction)
    train = PackedSequences(tokens[: len(tokens) - num_val], seq_len)
    val = PackedSequences(tokens[len(tokens) - num_val :], seq_len)
    if len(val) == 0 or len(train) == 0:
        raise ValueError(
            f"data.seq_len={seq_len}: the corpus has {len(tokens)} tokens, {num_val} of them "
            "held out, too few for one sequence of each; "
            + _more_text(max_bytes, "lower data.seq_len")
        )
    return Datasets(
        train,
        val,
        vocab_size=vocab_size,
        block_size=seq_len,
        tokenizer=name,
        num_tokens=len(tokens),
        corpus_sha256=hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
    )


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A nanoGPT-style decoder: token and learned position embeddings, `n_layer` blocks, a
    final LayerNorm and a head tied to the token embedding. input_ids (B, T) -> logits
    (B, T, vocab_size)."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is not a multiple of model.n_head={n_head}")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))  # GPT-2's residual scaling

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than block_size={self.block_size}"
            )
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
