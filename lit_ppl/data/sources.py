"""Where documents come from: local files (any extension, compressed or not, directories, globs) or a hub dataset,
as a :class:`DataSpec` with its files resolved, its format decided and its token store's key.

:mod:`lit_ppl.data.reading` reads them: plain text streamed a chunk at a time, JSON and Parquet through Hugging Face
``datasets`` (``load_dataset(..., streaming=True)``, its decompression of ``.gz``/``.bz2``/``.xz``/``.zst``), nothing
written to disk and memory bounded by a batch of documents. A hub dataset is downloaded into ``datasets``' cache (so
that a node without internet can read it later) and read from its memory-mapped Arrow files.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_ppl.config.values import DATA_FORMATS, ENCODING_ERRORS
from lit_ppl.errors import LitPplError
from lit_ppl.runtime.packages import is_package_url, package_file

DEMO_TEXT = "package://lit_ppl.assets/demo.txt"
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_BY_EXTENSION = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # anything else is text


@dataclass
class DataSpec:
    """Which documents to evaluate.

    Attributes:
        path: a file, a directory (every file in it, of one format), a glob (``c4/validation/*.json.gz``) or a
            list of these; files are read in sorted order. The default is a short text shipped with the package.
        format: ``auto`` (by extension: ``.jsonl``/``.json`` → json, ``.parquet`` → parquet, anything else → text,
            under any of ``.gz``/``.bz2``/``.xz``/``.zst``), or ``text``/``json``/``parquet`` for every file.
        hub_name: a hub dataset name (used when ``path`` is empty), e.g. ``wikitext``.
        hub_config: the hub dataset's configuration, e.g. ``wikitext-2-raw-v1``.
        split: which split of the hub dataset to evaluate.
        text_field: the column holding the text (json/parquet files and hub datasets).
        join_rows: concatenate all rows into one text before splitting (line-per-row hub datasets such as
            WikiText; the joined text is held in memory).
        document_separator: a regex that splits each text into documents (``None``: one text, one document).
        encoding_errors: how text that is not valid UTF-8 is read: ``strict`` (an error naming the file and byte
            offset), ``replace`` (U+FFFD) or ``ignore``.
        limit: evaluate only the first ``limit`` documents (lm-eval's ``--limit``); ``None``: all.
        num_proc: processes tokenizing a corpus the first time (``None``: the CPUs this process may use).
        cache_dir: where tokenized corpora are kept (``None``: ``$LIT_PPL_CACHE``, else
            ``$XDG_CACHE_HOME/lit_ppl``, else ``~/.cache/lit_ppl``); a directory every node can read keeps one
            copy per job.
    """

    path: Any = DEMO_TEXT
    format: str = "auto"
    hub_name: str | None = None
    hub_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    join_rows: bool = False
    document_separator: str | None = None
    encoding_errors: str = "strict"
    limit: int | None = None
    num_proc: int | None = None
    cache_dir: str | None = None
    paths: list[str] = field(init=False)
    builder: str = field(init=False)

    def __post_init__(self) -> None:
        if self.format not in DATA_FORMATS:
            raise LitPplError(f"data.format={self.format!r} is not one of {', '.join(DATA_FORMATS)}")
        raw = [] if self.path in (None, "") else [self.path] if isinstance(self.path, str) else list(self.path)
        self.paths = expand_paths([str(p) for p in raw])
        if not self.paths and not self.hub_name:
            raise LitPplError("no data: set data.path=FILE (a directory, a glob or a list) or data.hub_name=NAME")
        self.builder = builder_of(self.paths, self.format) if self.paths else "hub"
        if self.encoding_errors not in ENCODING_ERRORS:
            raise LitPplError(
                f"data.encoding_errors={self.encoding_errors!r} is not one of {', '.join(ENCODING_ERRORS)}"
            )
        if self.limit is not None and (type(self.limit) is not int or self.limit < 1):
            raise LitPplError(f"data.limit={self.limit!r} must be a positive number of documents or null")
        if self.num_proc is not None and (type(self.num_proc) is not int or self.num_proc < 1):
            raise LitPplError(f"data.num_proc={self.num_proc!r} must be a positive number of processes or null")
        if self.document_separator is not None:
            try:
                re.compile(self.document_separator)
            except re.error as err:
                raise LitPplError(f"data.document_separator={self.document_separator!r} is not a regex: {err}") from err

    def fingerprint(self, tokenizer_fingerprint: str, version: str) -> str:
        """Key of the tokenized corpus: the files (path, size, mtime, ctime) or the hub dataset, the reading options
        and the tokenizer. Contents are not hashed (a gigabyte would cost seconds at every start): a file rewritten
        in place changes its ctime, which ``touch -d`` cannot set back, so it gets a new key."""
        stats = [(p, *_stat(p)) for p in self.paths]
        options = {k: getattr(self, k) for k in ("format", "text_field", "join_rows", "document_separator")}
        options |= {"encoding_errors": self.encoding_errors, "limit": self.limit}
        key = {"files": stats, "hub": [self.hub_name, self.hub_config, self.split], **options}
        key |= {"tokenizer": tokenizer_fingerprint, "version": version}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def describe(self) -> str:
        if not self.paths:
            return f"hub dataset {self.hub_name} ({self.hub_config}, {self.split})"
        return self.paths[0] if len(self.paths) == 1 else f"{len(self.paths)} files from {self.paths[0]}"


def _stat(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _inner_suffix(path: str) -> str:
    p = Path(path)
    return Path(p.stem).suffix if p.suffix in COMPRESSIONS else p.suffix


def file_format(path: str) -> str:
    """``text``, ``json`` or ``parquet`` from the extension under any compression suffix."""
    return _BY_EXTENSION.get(_inner_suffix(path).lower(), "text")


def builder_of(paths: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = {p: file_format(p) for p in paths}
    if len(set(kinds.values())) > 1:
        example = {k: next(p for p, f in kinds.items() if f == k) for k in sorted(set(kinds.values()))}
        raise LitPplError(
            f"data.path mixes formats {example}; give files of one format, or set data.format=text|json|parquet"
        )
    return next(iter(kinds.values()))


def expand_paths(raw: list[str]) -> list[str]:
    """Files named by ``raw`` (files, directories, globs, ``package://`` resources): each entry's files sorted,
    entries in the order given, no file twice."""
    out: list[str] = []
    for entry in raw:
        if is_package_url(entry):
            found = [str(package_file(entry, "data.path"))]
        elif glob.has_magic(entry):
            found = sorted(p for p in glob.glob(os.path.expanduser(entry), recursive=True) if Path(p).is_file())
            if not found:
                raise FileNotFoundError(f"data.path={entry!r} matches no files")
        else:
            local = Path(entry).expanduser()
            if local.is_dir():
                found = sorted(str(p) for p in local.rglob("*") if p.is_file() and not _hidden(p, local))
                if not found:
                    raise FileNotFoundError(f"data.path={entry!r} is an empty directory")
            elif local.is_file():
                found = [str(local)]
            else:
                raise FileNotFoundError(f"data.path={entry!r} is not a file, a directory or a glob that matches")
        out.extend(str(Path(p).resolve()) for p in found)
    return list(dict.fromkeys(out))


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)
