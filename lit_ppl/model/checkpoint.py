"""A checkpoint's files as lit-ppl checks them, each problem in one line: the safetensors headers before any weight
is read (a file cut short by an interrupted download), and after loading, the tensors transformers found missing,
unexpected or of the wrong shape, said instead of its multi-line report. A GGUF file's header is checked by
``gguf``'s own reader (:func:`lit_ppl.model.formats.gguf_description`)."""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_ppl.errors import LitPplError, first_line

if TYPE_CHECKING:
    import torch


def safetensors_files(path: str, root: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` would read in ``root``: ``model.safetensors``, or the shards its
    index names (empty: the checkpoint holds none)."""
    return _weight_files(path, root, "model.safetensors", "a safetensors index")


def bin_files(path: str, root: Path) -> list[Path]:
    """The PyTorch files ``from_pretrained`` reads where ``root`` holds no safetensors: ``pytorch_model.bin``, or
    the shards its index names."""
    return _weight_files(path, root, "pytorch_model.bin", "an index of PyTorch weight files")


def weight_files(path: str, root: Path) -> list[Path]:
    """The weight files ``from_pretrained`` reads in ``root``: its safetensors, else its PyTorch files."""
    return safetensors_files(path, root) or bin_files(path, root)


def _weight_files(path: str, root: Path, single: str, what: str) -> list[Path]:
    index = root / f"{single}.index.json"
    if (root / single).is_file():
        return [root / single]
    if not index.is_file():
        return []
    try:
        return sorted({root / name for name in json.loads(index.read_text())["weight_map"].values()})
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise LitPplError(f"model.path={path!r}: {index.name} is not {what} ({err})") from None


class WeightFile:
    """One weight file opened for reading its tensors' names, shapes and regions: a safetensors file (mapped by
    safetensors) or a PyTorch zip file (``torch.load(mmap=True, weights_only=True)``: tensors and numbers, never code;
    only the pages a read touches are read). Use as a context manager; a region read is a copy of its own."""

    def __init__(self, file: str) -> None:
        self.file = file
        self._handle: Any = None

    def __enter__(self) -> WeightFile:
        if self.file.endswith(".safetensors"):
            from safetensors import safe_open

            self._handle = safe_open(self.file, "pt").__enter__()
        else:
            import torch

            self._handle = torch.load(self.file, map_location="cpu", weights_only=True, mmap=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if hasattr(self._handle, "__exit__"):
            self._handle.__exit__(*exc)
        self._handle = None

    def names(self) -> list[str]:
        """Its tensors' names (a PyTorch file may hold other values beside them)."""
        h = self._handle
        return [k for k, v in h.items() if hasattr(v, "shape")] if isinstance(h, dict) else list(h.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        h = self._handle
        return tuple(h[key].shape) if isinstance(h, dict) else tuple(h.get_slice(key).get_shape())

    def read(self, key: str, region: tuple[slice, ...] = ()) -> torch.Tensor:
        h = self._handle
        if isinstance(h, dict):
            return h[key][region].clone()
        return h.get_slice(key)[region] if region else h.get_tensor(key)


def checkpoint_root(location: str, hub_id: str, revision: str | None) -> Path | None:
    """The checkpoint's directory: ``location``, or a hub id's cached snapshot (``None``: not cached)."""
    root = Path(location).expanduser()
    if root.is_dir():
        return root
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hub_id, revision=revision, local_files_only=True))
    except Exception:  # not cached: from_pretrained will say so
        return None


def hub_unreachable(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) says the hub could not be reached or offline mode forbade it."""
    seen: BaseException | None = err
    while seen is not None:
        names = {c.__name__ for c in type(seen).__mro__}
        if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectError"}:
            return True
        if "couldn't connect to" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_safetensors(path: str, root: Path) -> None:
    """Every safetensors file ``from_pretrained`` would read in ``root`` opens: a header that parses and a file as
    long as its tensors need."""
    from safetensors import SafetensorError, safe_open

    index = root / "model.safetensors.index.json"
    for f in safetensors_files(path, root):
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


def tensor_sources(path: str, files: list[Path], lm: Any) -> dict[str, tuple[str, str]] | None:
    """Where each of ``lm``'s tensors lies in the weight ``files`` (safetensors, or PyTorch zip files): model key →
    ``(file, checkpoint key)``.

    ``lm`` is the model as built (on the meta device). The checkpoint's keys are renamed as ``from_pretrained``
    renames them — transformers' own conversion mapping (``get_model_conversion_mapping``: GPT-NeoX's
    ``embed_out``, legacy ``gamma``/``beta``), its base-model prefix, the unexpected keys it ignores — and a tied
    parameter is read from whichever of its names the checkpoint holds, the tie's source first. ``None`` where
    ``from_pretrained`` does more than rename: a converter that fuses or splits tensors (mixture-of-experts
    layers), or a missing tensor it initialises itself; that model is read whole by one reader instead. A
    checkpoint lacking a tensor, holding one the model does not use, or one of the wrong shape: one line. ``None``
    too for a PyTorch file in the legacy format, which cannot be mapped.
    """

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(lm)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = lm.state_dict()
    found: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for f in files:
        try:
            with WeightFile(str(f)) as handle:
                shapes = {key: handle.shape(key) for key in handle.names()}
        except (RuntimeError, pickle.UnpicklingError):
            if f.suffix == ".safetensors":
                raise
            return None  # a PyTorch file in the legacy (non-zip) format, which cannot be mapped
        for key, shape in shapes.items():
            name, converted = rename_source_key(key, renamings, converters, lm.base_model_prefix, meta)
            if converted is not None:
                return None
            found[name] = (str(f), key, shape)
    buffers = {n for n, _ in lm.named_buffers()}
    unexpected = [n for n in found if n not in meta and not _ignored(lm, "unexpected", n, buffers)]
    sources, missing, mismatched = {}, [], []
    for names in aliases(lm, meta):
        have = [n for n in names if n in found]
        if not have:  # a buffer the checkpoint lacks keeps the value the model's __init__ computed
            missing += [n for n in names if n not in buffers]
            continue
        file, key, shape = found[have[0]]
        if shape != tuple(meta[names[0]].shape):
            mismatched.append(f"{have[0]} (checkpoint {list(shape)}, model {list(meta[names[0]].shape)})")
        sources.update(dict.fromkeys(names, (file, key)))
    if any(_ignored(lm, "missing", n, buffers) for n in missing):
        return None  # from_pretrained initialises these itself
    problem = key_problem(path, missing, unexpected, mismatched)
    if problem:
        raise LitPplError(problem)
    return sources


class FileParts:
    """The tensors :func:`tensor_sources` found, by the model's names; iterate to read them lazily: (model name, a
    slice handle of the open file, indexed like a tensor). Tied names come once each."""

    def __init__(self, sources: dict[str, tuple[str, str]]) -> None:
        self.sources = sources

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name in sorted(self.sources):
            yield name, _Slice(*self.sources[name])


class _Slice:
    """A tensor of a weight file, indexed like a tensor (a scalar by its empty index). The file is opened per
    read: it is mapped, and the pages a read touches stay in this process's RSS until it closes — a rank's
    share of a 768 MiB embedding table, read block by block through one open file, would all stay resident."""

    def __init__(self, file: str, key: str) -> None:
        self.file, self.key = file, key
        with WeightFile(file) as handle:
            self.shape = handle.shape(key)

    def __getitem__(self, region: tuple[slice, ...]) -> Any:
        with WeightFile(self.file) as handle:
            return handle.read(self.key, region if self.shape else ())


def aliases(lm: Any, meta: dict[str, Any]) -> list[list[str]]:
    """The model's state-dict names grouped by the tensor they name (tied weights share one), each group's tie
    source (``all_tied_weights_keys``' values) first."""
    groups: dict[int, list[str]] = {}
    for name, param in lm.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    named = {n for g in groups.values() for n in g}
    sources = set((getattr(lm, "all_tied_weights_keys", None) or {}).values())
    out = [sorted(g, key=lambda n: (n not in sources, n)) for g in groups.values()]
    return out + [[n] for n in meta if n not in named]


def _ignored(lm: Any, kind: str, name: str, buffers: set[str]) -> bool:
    """Whether ``from_pretrained`` ignores a ``kind`` ("missing" or "unexpected") key: the model's
    ``_keys_to_ignore_on_load_*`` patterns, and the stale rotary and position-id buffers of old checkpoints."""
    import re

    patterns = set(getattr(lm, f"_keys_to_ignore_on_load_{kind}", None) or ())
    if kind == "unexpected":
        patterns |= {r"rotary_emb\.inv_freq"} if any(b.endswith("rotary_emb.inv_freq") for b in buffers) else set()
        patterns |= {r"(^|\.)position_ids$"} if any(b.endswith("position_ids") for b in buffers) else set()
    return any(re.search(p, name) for p in patterns)
