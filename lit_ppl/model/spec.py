"""Causal LMs: a built-in random-init Llama for offline runs, or any Hugging Face checkpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import LitPplError, first_line
from lit_ppl.model.checkpoint import (
    FileParts,
    check_safetensors,
    checkpoint_root,
    hub_unreachable,
    key_problem,
    tensor_sources,
    weight_files,
    without_load_report,
)
from lit_ppl.model.gguf_weights import GgufParts
from lit_ppl.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from lit_ppl.runtime.packages import is_package_url, package_file

BUILTIN = "builtin"


@dataclass
class ModelSpec:
    """Which causal LM to evaluate.

    Attributes:
        path: ``builtin`` (no files: byte tokenizer and a seeded random Llama), a local Hugging Face
            checkpoint directory, a GGUF file (``FILE.gguf``), a file inside an installed package
            (``package://PACKAGE/FILE.gguf``: ``model=demo``), or a hub id (needs the hub or its cache).
        gguf_file: the GGUF file in the directory or hub repository ``path`` (set from ``path`` when that is a
            ``.gguf`` file); read by transformers' GGUF loader, every tensor dequantized as llama.cpp defines it.
        trust_remote_code: run the checkpoint's own Python code; off unless you trust its source.
        revision: hub revision (branch, tag or commit) for hub ids.
        seed: initialisation seed of the built-in model.
        hidden_size: built-in model width.
        num_layers: built-in model depth.
        num_heads: built-in model attention heads.
        max_positions: built-in model context length.
    """

    path: str = BUILTIN
    gguf_file: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 2048

    def __post_init__(self) -> None:
        if self.is_builtin:
            return
        if is_package_url(self.path):  # model=demo: a file inside an installed wheel, read in place
            self.path = str(package_file(self.path, "model.path"))
        local = Path(self.path).expanduser()
        if self.gguf_file is None and self.path.endswith(".gguf") and local.is_file():
            self.gguf_file = local.name  # transformers reads a GGUF as a file of its directory (self.location)
        if self.gguf_file is not None and local.is_dir() and not (local / self.gguf_file).is_file():
            ggufs = sorted(p.name for p in local.glob("*.gguf"))
            raise LitPplError(
                f"model.gguf_file={self.gguf_file!r} is not a file in {self.path!r}; "
                f"{'its GGUF files: ' + ', '.join(ggufs[:5]) if ggufs else 'the directory holds no .gguf file'}"
            )
        # Hub ids are "name" or "org/name"; anything else is meant as a local directory.
        looks_local = self.path.startswith(("/", ".", "~")) or self.path.count("/") > 1
        if looks_local and not local.exists():
            raise FileNotFoundError(
                f"model.path={self.path!r} does not exist; give a Hugging Face checkpoint directory, a hub id "
                f"(org/name) or '{BUILTIN}'"
            )
        if local.is_dir() and self.gguf_file is None and not (local / "config.json").is_file():
            raise LitPplError(
                f"model.path={self.path!r} is a directory without config.json, so not a Hugging Face causal LM "
                "checkpoint (expected config.json plus *.safetensors weights, or give a GGUF file: "
                "model.path=FILE.gguf or model.gguf_file=NAME)"
            )

    @property
    def is_builtin(self) -> bool:
        return self.path == BUILTIN

    @property
    def location(self) -> str:
        """What ``from_pretrained`` reads: ``path``, or the directory of ``path`` when that is the GGUF file."""
        local = Path(self.path).expanduser()
        return str(local.parent) if self.gguf_file is not None and local.is_file() else self.path

    def _from_pretrained(self, auto_class: type, problem: str, **kwargs: Any) -> Any:
        """``auto_class.from_pretrained(path)``, its failure reported as one line naming ``model.path``."""
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        try:
            return auto_class.from_pretrained(
                str(Path(self.location).expanduser()),
                trust_remote_code=self.trust_remote_code,
                revision=self.revision,
                **kwargs,
            )
        except (OSError, ValueError, KeyError) as err:
            if not Path(self.location).expanduser().is_dir() and hub_unreachable(err):
                raise LitPplError(
                    f"model.path={self.path!r} is not a local directory, not in the Hugging Face cache, and the hub "
                    f"cannot be reached; run `python -m lit_ppl.fetch model.path={self.path}` where the hub is "
                    "reachable (with HF_HOME on storage these nodes read), or give a local checkpoint directory"
                ) from None
            raise LitPplError(f"model.path={self.path!r} {problem}: {first_line(err)}") from err

    def download(self) -> str | None:
        """Fetch a hub id's files into the Hugging Face cache (``None`` for the built-in model or a directory)."""
        if self.is_builtin or Path(self.location).expanduser().is_dir():
            return None
        from huggingface_hub import HfApi, hf_hub_download, snapshot_download

        if self.gguf_file is not None:  # the one file: config, tokenizer and weights are all in it
            return str(Path(hf_hub_download(self.path, self.gguf_file, revision=self.revision)).parent)
        names = HfApi().list_repo_files(self.path, revision=self.revision)
        # The weights once, in the format from_pretrained prefers; not the original/ consolidated copies.
        ignore = ["original/*", "*.pth", "*.msgpack", "*.h5", "*.ot", "*.onnx", "*.gguf", "*.tflite"]
        if any(n.endswith(".safetensors") for n in names):
            ignore.append("*.bin")
        return snapshot_download(self.path, revision=self.revision, ignore_patterns=ignore)

    def files(self) -> list[tuple[str, int, int, int]]:
        """Every file of the checkpoint (a hub id's cached snapshot) as ``(name, size, mtime_ns, ctime_ns)``, from
        ``stat`` alone: which weights these are, at no cost whatever their size. Empty for the built-in model or a
        hub id not in the cache."""
        if self.is_builtin:
            return []
        root = checkpoint_root(self.location, self.path, self.revision)
        if root is None:
            return []
        out = []
        found = [root / self.gguf_file] if self.gguf_file is not None else sorted(root.rglob("*"))
        for f in found:
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts):
                st = f.stat()  # through a hub snapshot's symlinks: the blob's own times
                out.append((str(f.relative_to(root)), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return out

    def identity(self) -> dict[str, Any]:
        """The checkpoint's identity, from one ``stat`` of each of :meth:`files`: ``digest`` covers their names,
        sizes and times (an edited or replaced file changes it, even one given the old mtime back, since ``touch``
        cannot reset a ctime: what resume and ``results.json`` need); ``names_digest`` their names and sizes only
        (what copies of the same checkpoint on other nodes share: what the ranks' agreement check needs)."""
        import hashlib
        import json

        files = self.files()
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}
        if fields["gguf_file"] is None:  # left out when unset: digests already stored (progress, results) still match
            del fields["gguf_file"]

        def digest(entries: list) -> str:
            blob = json.dumps({"fields": fields, "files": entries}, sort_keys=True).encode()
            return hashlib.sha256(blob).hexdigest()[:20]

        return {
            "digest": digest(files),
            "names_digest": digest([f[:2] for f in files]),
            "files": len(files),
            "bytes": sum(f[1] for f in files),
        }

    def stored_quantization(self) -> dict[str, Any] | None:
        """The checkpoint's own quantization (``source: checkpoint``; :mod:`lit_ppl.model.formats`), ``None`` for
        float weights."""
        if self.is_builtin:
            return None
        if "stored" not in self.__dict__:  # read once: the table, results.json and the layout all ask
            from lit_ppl.model.formats import gguf_description, hf_description

            root = Path(self.location).expanduser()
            if self.gguf_file is not None:
                self.__dict__["stored"] = gguf_description(root / self.gguf_file)
            else:
                qc = getattr(self.config(), "quantization_config", None)
                qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
                self.__dict__["stored"] = hf_description(self.path, root, qc) if qc else None
        return self.__dict__["stored"]

    def limits(self) -> tuple[int, int | None]:
        """``(vocab_size, max_positions)`` from the model's config, without loading its weights."""
        if self.is_builtin:
            return ByteTokenizer.vocab_size, self.max_positions
        from transformers import AutoConfig

        root = Path(self.location).expanduser()
        if root.is_dir():  # local files, damaged or cut short (an interrupted download): one line before any is read
            if self.gguf_file is not None:
                self.stored_quantization()  # gguf's own reader checks the header and every tensor's extent
            else:
                check_safetensors(self.path, root)
        cfg = self._from_pretrained(AutoConfig, "has no config transformers can read")
        self.stored_quantization()  # a quantized format this installation cannot run: one line now
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not self.trust_remote_code:
            raise LitPplError(
                f"model.path={self.path!r} is a {cfg.model_type!r} model, not a causal LM that "
                "AutoModelForCausalLM can load (e.g. llama, mistral, qwen2, gpt2)"
            )
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return cfg.vocab_size, getattr(cfg, "max_position_embeddings", None)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer that goes with this model."""
        if self.is_builtin:
            return ByteTokenizer()
        from transformers import AutoTokenizer

        return HFTokenizer(self._from_pretrained(AutoTokenizer, "has no tokenizer transformers can load"))

    def build_empty(self, dtype: torch.dtype) -> nn.Module:
        """The model with parameters on the meta device (no memory) and real buffers, in eval mode."""
        from transformers import AutoModelForCausalLM

        cfg = self.config()
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=self.trust_remote_code)
        return model.eval().requires_grad_(False)

    def full_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Exactly the tensors ``from_pretrained`` loads, keyed as the model names them, in host memory.

        transformers' own loading renames the checkpoint's keys (GPT-NeoX's ``embed_out``), fuses per-expert
        tensors into the 3D expert parameters of mixture-of-experts layers and ties weights; reading the
        safetensors files directly would bypass all of it.
        """
        with torch.device("cpu"):  # never the whole model on one accelerator
            return self.build(dtype).state_dict()

    def tensor_parts(self, lm: nn.Module) -> Iterable[tuple[str, Any]] | None:
        """``lm``'s tensors (:meth:`build_empty`'s, before any split) read one at a time, each rank keeping its part
        (:func:`~lit_ppl.parallel.sharding.load_own_parts`): a GGUF's, safetensors' or zip-format ``.bin``'s; ``None``
        where rank 0 reads it by ``from_pretrained``: quantized, remote code, legacy ``.bin``, fused experts."""
        if self.is_builtin or self.trust_remote_code:
            return None
        root = checkpoint_root(self.location, self.path, self.revision)
        if self.gguf_file is not None:
            return GgufParts(self.path, root / self.gguf_file, lm) if root is not None else None
        files = weight_files(self.path, root) if root is not None else []
        if self.stored_quantization() or not files:
            return None
        sources = tensor_sources(self.path, files, lm)
        return FileParts(sources) if sources is not None else None

    def config(self) -> Any:
        """The model's transformers config (the built-in model's, or the checkpoint's), without its weights."""
        from transformers import AutoConfig, LlamaConfig

        if not self.is_builtin:
            return self._from_pretrained(AutoConfig, "has no config transformers can read")
        return LlamaConfig(
            vocab_size=ByteTokenizer.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=4 * self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_positions,
            bos_token_id=ByteTokenizer.bos_id,
            eos_token_id=ByteTokenizer.eos_id,
            tie_word_embeddings=True,
        )

    def build(self, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> nn.Module:
        """Instantiate the model in ``dtype`` on ``device`` (default: the current default device), in eval mode.

        A checkpoint is read straight to ``device`` (``device_map``): never a host copy per rank on the way to its
        GPU, which for eight ranks of a 70B model would be over a terabyte of RAM.
        """
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        if self.is_builtin:
            config = self.config()
            # Seeded locally, and always drawn in float32 then cast, so the same seed gives the same weights
            # on every rank, in every run and under every precision (a "*-true" plugin changes the default
            # dtype while the model is built, and a float64 draw is a different draw).
            default_dtype = torch.get_default_dtype()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                torch.set_default_dtype(torch.float32)
                try:
                    model = LlamaForCausalLM(config)
                finally:
                    torch.set_default_dtype(default_dtype)
            model = model.to(dtype)
        elif self.gguf_file is not None and (parts := self.tensor_parts(model := self.build_empty(dtype))):
            from lit_ppl.parallel.sharding import load_own_parts, materialize

            materialize(model, device or torch.get_default_device())
            load_own_parts(model, parts, {}, None)  # a tensor at a time: never the whole file dequantized at once
        else:
            placement = {} if device is None else {"device_map": {"": str(device)}}
            with without_load_report():
                model, info = self._from_pretrained(
                    AutoModelForCausalLM,
                    "is not a causal LM transformers can load",
                    dtype=dtype,
                    output_loading_info=True,
                    ignore_mismatched_sizes=True,  # a tensor of the wrong shape is reported, then refused below
                    **placement,
                )
            self.check_loading(info)
        return model.eval().requires_grad_(False)

    def check_loading(self, info: dict[str, Any]) -> None:
        """Refuse a checkpoint that does not provide exactly the model's tensors (``from_pretrained``'s report).

        transformers initialises a missing tensor at random and drops an unexpected one, with a log line at
        most: either way the perplexity would be that of another model.
        """
        mismatched = info.get("mismatched_keys") or []
        mismatched = [f"{k} (checkpoint {list(theirs)}, model {list(ours)})" for k, theirs, ours in mismatched]
        problem = key_problem(self.path, info.get("missing_keys") or [], info.get("unexpected_keys") or [], mismatched)
        if problem:
            raise LitPplError(problem)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while buffers (rotary frequencies, ...) are computed for real.

    Sharded evaluation then materialises only each rank's shard; the buffers, which no checkpoint holds, keep
    the values the model's own ``__init__`` computed.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
