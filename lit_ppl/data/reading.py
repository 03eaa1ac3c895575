"""Reading a corpus's documents: plain-text files streamed a chunk at a time (a large one in parts), JSON and
Parquet through Hugging Face ``datasets``, hub datasets; every failure one line naming the file or row."""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lit_ppl.data.sources import COMPRESSIONS, DataSpec
from lit_ppl.errors import LitPplError, first_line

CHUNK_CHARS = 1 << 20  # a plain-text file is read this many characters at a time
SEPARATOR_LOOKAHEAD = 1 << 16  # a separator match ending this close to the read text's end may still grow


class Part(str):
    """A piece of a document read in parts (a plain-text file larger than :data:`CHUNK_CHARS`); ``continues``:
    it continues the previous item's document. The tokenizer joins the parts (:mod:`lit_ppl.data.tokenize`)."""

    continues: bool = False


def _part(text: str, continues: bool) -> Part:
    part = Part(text)
    part.continues = continues
    return part


def documents(spec: DataSpec, batch_size: int = 256) -> Iterator[list[str]]:
    """The documents in order, ``batch_size`` at a time, at most ``spec.limit`` of them. A plain-text document
    larger than :data:`CHUNK_CHARS` comes as :class:`Part` items, each a batch of its own."""
    left = spec.limit if spec.limit is not None else float("inf")
    streamed = spec.builder == "text" and bool(spec.paths) and not spec.join_rows
    for batch in _stream_text(spec, batch_size) if streamed else _split(spec, _texts(spec, batch_size)):
        starts = sum(not getattr(d, "continues", False) for d in batch)
        if left <= 0 and starts:
            return
        if starts > left:  # the first `left` documents of the batch, with their parts
            kept, seen = [], 0
            for d in batch:
                seen += not getattr(d, "continues", False)
                if seen > left:
                    break
                kept.append(d)
            batch, starts = kept, int(left)
        left -= starts
        yield batch


def _stream_text(spec: DataSpec, batch_size: int) -> Iterator[list[str]]:
    """Plain-text files read :data:`CHUNK_CHARS` at a time, never whole: each file one document, or split at
    ``data.document_separator`` as ``re.split`` splits the whole text (matches found left to right, each scan
    resuming after the last match; a match is taken only once the text read extends past it)."""
    with _read_errors(spec, {}):
        for path in spec.paths:
            yield from _stream_file(spec, path, batch_size)


def _stream_file(spec: DataSpec, path: str, batch_size: int) -> Iterator[list[str]]:
    import fsspec

    separator = re.compile(spec.document_separator) if spec.document_separator is not None else None
    out: list[str] = []
    buffer, in_doc, eof, read_any = "", False, False, False
    # Universal newlines, as datasets' text reader (and so the stores built before) read a file.
    with fsspec.open(path, "rt", compression="infer", encoding="utf-8", errors=spec.encoding_errors) as f:
        while not eof:
            chunk = f.read(CHUNK_CHARS)
            eof, read_any = not chunk, read_any or bool(chunk)
            buffer += chunk
            if separator is not None:
                limit = len(buffer) if eof else len(buffer) - SEPARATOR_LOOKAHEAD
                pos = 0
                for m in separator.finditer(buffer):
                    if m.end() == m.start():
                        raise LitPplError(
                            f"data.document_separator={spec.document_separator!r} matches an empty string (at "
                            f"character {m.start()} of a read); give a separator that matches at least one character"
                        )
                    if m.end() > limit:
                        break
                    doc = buffer[pos : m.start()]
                    if in_doc or doc.strip():  # re.split's empty and blank pieces are not documents
                        out.append(_part(doc, True) if in_doc else doc)
                    in_doc, pos = False, m.end()
                buffer = buffer[pos:]
            if eof:
                if in_doc or (buffer.strip() if separator is not None else (buffer or not read_any)):
                    out.append(_part(buffer, True) if in_doc else buffer)
            elif len(buffer) > CHUNK_CHARS + SEPARATOR_LOOKAHEAD:  # a document larger than a chunk: in parts
                keep = SEPARATOR_LOOKAHEAD if separator is not None else 0
                out.append(_part(buffer[: len(buffer) - keep], in_doc))
                buffer, in_doc = buffer[len(buffer) - keep :], True
            while out and (eof or len(out) >= batch_size or isinstance(out[-1], Part)):
                yield out[:batch_size]
                out = out[batch_size:]


def _split(spec: DataSpec, texts: Iterator[list[str]]) -> Iterator[list[str]]:
    if spec.join_rows:
        texts = iter([["".join(t for batch in texts for t in batch)]])
    for batch in texts:
        if spec.document_separator is not None:
            batch = [d for t in batch for d in re.split(spec.document_separator, t) if d.strip()]
        if batch:
            yield batch


def _texts(spec: DataSpec, batch_size: int) -> Iterator[list[str]]:
    if not spec.paths:
        yield from _column(_load_hub(spec).iter(batch_size=batch_size), spec, spec.describe())
        return
    import datasets

    kwargs: dict[str, Any] = {}
    if spec.builder == "text":
        kwargs = {"sample_by": "document", "encoding_errors": spec.encoding_errors}
    # One reader over every file, in order (one per file would cost a setup each for thousands of shards); the
    # file at fault is looked for only when reading fails.
    with _read_errors(spec, kwargs):
        ds = datasets.load_dataset(spec.builder, data_files=spec.paths, split="train", streaming=True, **kwargs)
        yield from _column(ds.iter(batch_size=batch_size), spec, spec.describe())


@contextmanager
def _read_errors(spec: DataSpec, kwargs: dict[str, Any]) -> Iterator[None]:
    """A failure to read the files as one line naming the file: invalid UTF-8 (with its byte offset), a corrupt
    compressed file, a file pyarrow cannot parse."""
    try:
        yield
    except UnicodeDecodeError:
        path, offset = next((p, o) for p in spec.paths if (o := _bad_utf8_offset(p)) is not None)
        raise LitPplError(
            f"{path} is not valid UTF-8 at byte offset {offset}; fix the file or set data.encoding_errors=replace "
            "(or ignore)"
        ) from None
    except (OSError, EOFError, ValueError) as err:
        if isinstance(err, LitPplError):
            raise
        bad = next(((p, e) for p in spec.paths if (e := _decompress_error(p)) is not None), None)
        if bad is not None:
            raise LitPplError(f"data.path file {bad[0]} is not a valid {Path(bad[0]).suffix} file: {bad[1]}") from err
        if type(err).__name__ != "ArrowInvalid":  # pyarrow's word for a file it cannot parse
            raise
        where = _unreadable(spec, kwargs) or spec.describe()
        raise LitPplError(f"data.path file {where} cannot be read as {spec.builder}: {first_line(err)}") from None


def _unreadable(spec: DataSpec, kwargs: dict[str, Any]) -> str | None:
    """The first file that cannot be read alone (looked for only once reading all of them failed)."""
    import datasets

    for path in spec.paths:
        try:
            ds = datasets.load_dataset(spec.builder, data_files=[path], split="train", streaming=True, **kwargs)
            for _ in ds.iter(batch_size=1024):
                pass
        except Exception:
            return path
    return None


def _column(batches: Iterator[dict[str, list]], spec: DataSpec, where: str) -> Iterator[list[str]]:
    row = 0
    for batch in batches:
        if spec.text_field not in batch:
            raise LitPplError(f"data.text_field={spec.text_field!r} is not a column of {where}; it has {sorted(batch)}")
        texts = batch[spec.text_field]
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                what = "missing or null" if text is None else f"{type(text).__name__} {str(text)[:40]!r}"
                raise LitPplError(
                    f"row {row + i} of {where}: data.text_field={spec.text_field!r} is {what}, not text; every row "
                    "needs a string there (or choose another data.text_field)"
                )
        row += len(texts)
        yield texts


def _chunks(path: str) -> Iterator[bytes]:
    """The file's bytes, decompressed by its suffix, a megabyte at a time."""
    import fsspec

    with fsspec.open(path, "rb", compression="infer") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def _bad_utf8_offset(path: str) -> int | None:
    """Byte offset of the first invalid UTF-8 sequence in the (decompressed) file; ``None`` if there is none."""
    decoder, offset, pending = codecs.getincrementaldecoder("utf-8")(), 0, 0
    try:
        for chunk in _chunks(path):
            pending = len(decoder.getstate()[0])  # an incomplete sequence carried over from the last chunk
            decoder.decode(chunk)
            offset += len(chunk)
        pending = len(decoder.getstate()[0])
        decoder.decode(b"", final=True)  # a sequence cut off by the end of the file
    except UnicodeDecodeError as err:
        return offset - pending + err.start
    return None


def _decompress_error(path: str) -> Exception | None:
    """What goes wrong decompressing ``path`` to its end (``None``: nothing, or not a compressed file)."""
    if Path(path).suffix not in COMPRESSIONS:
        return None
    try:
        for _ in _chunks(path):
            pass
    except Exception as err:  # each codec has its own error types (zlib, lzma, zstd, EOFError...)
        return err
    return None


def _load_hub(spec: DataSpec):
    import datasets

    try:
        return datasets.load_dataset(spec.hub_name, spec.hub_config, split=spec.split)
    except ConnectionError as err:
        raise LitPplError(
            f"data.hub_name={spec.hub_name!r} is not in the datasets cache and the hub cannot be reached ({err}); "
            "run `python -m lit_ppl.fetch` with the same model and data overrides where the hub is reachable (with "
            "HF_HOME and data.cache_dir on storage these nodes read), or give a local data.path"
        ) from None
