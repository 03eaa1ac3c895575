"""A checkpoint's files as lit-ppl checks them, each problem in one line: the safetensors headers before any weight
is read (a file cut short by an interrupted download), and after loading, the tensors transformers found missing,
unexpected or of the wrong shape, said instead of its multi-line report. A GGUF file's header is checked by
``gguf``'s own reader (:func:`lit_ppl.model.formats.gguf_description`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lit_ppl.errors import LitPplError, first_line


def check_safetensors(path: str, root: Path) -> None:
    """Every safetensors file ``from_pretrained`` would read in ``root`` (``model.safetensors``, or the shards its
    index names) opens: a header that parses and a file as long as its tensors need."""
    from safetensors import SafetensorError, safe_open

    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif index.is_file():
        try:
            files = sorted({root / name for name in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise LitPplError(f"model.path={path!r}: {index.name} is not a safetensors index ({err})") from None
    else:
        return
    for f in files:
        try:
            with safe_open(str(f), "pt"):
                pass
        except FileNotFoundError:
            raise LitPplError(f"model.path={path!r} lacks {f.name}, which {index.name} names") from None
        except (SafetensorError, OSError) as err:
            raise LitPplError(
                f"model.path={path!r}: {f.name} is not a complete safetensors file ({f.stat().st_size} bytes: "
                f"{first_line(err)}); an interrupted download? fetch it again"
            ) from None


def key_problem(
    path: str, missing: Iterable[str], unexpected: Iterable[str], mismatched: Iterable[str] = ()
) -> str | None:
    """One line naming what a checkpoint lacks, has in excess or has in the wrong shape (``None`` if nothing)."""
    for keys, what in (
        (missing, "lacks"),
        (unexpected, "has tensors the model does not use:"),
        (mismatched, "has tensors of the wrong shape:"),
    ):
        keys = sorted(keys)
        if keys:
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            return (
                f"model.path={path!r}: the checkpoint {what} {', '.join(keys[:5])}{more}; give a complete checkpoint "
                "of this architecture"
            )
    return None


class _NoLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


@contextmanager
def without_load_report() -> Iterator[None]:
    """Without transformers' table of missing, unexpected and mismatched tensors: one line says the same
    (:meth:`lit_ppl.model.spec.ModelSpec.check_loading`)."""
    logger, drop = logging.getLogger("transformers.modeling_utils"), _NoLoadReport()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
