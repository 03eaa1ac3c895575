"""Prepare a run for nodes without internet: download the model and the data, tokenize into the token store.

Run it where the hub is reachable, with the same overrides as the evaluation and with ``HF_HOME`` and
``data.cache_dir`` on storage the compute nodes read; the evaluation then runs with ``HF_HUB_OFFLINE=1``::

    python -m lit_ppl.fetch model.path=meta-llama/Llama-3.1-8B data=wikitext2 data.cache_dir=/shared/lit_ppl
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 srun python -m lit_ppl.validate <the same overrides> ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from lit_ppl import config
from lit_ppl.config.guard import construct
from lit_ppl.data.store import Corpus, prepare
from lit_ppl.run import exit_for
from lit_ppl.validate import conf_dir, entry


def fetch(cfg: DictConfig) -> Path:
    """Download what ``cfg`` evaluates and build its token store; return the store's directory."""
    config.check(cfg)  # the same checks as the evaluation, before anything is downloaded
    plain = OmegaConf.to_container(cfg, resolve=True)
    model = construct(plain["model"])
    snapshot = model.download()
    if snapshot:
        print(f"model: {model.path} in {snapshot}")
    spec = construct(plain["data"])
    store = prepare(spec, model.tokenizer(), cfg.distributed.timeout_s)
    corpus = Corpus.open(store)
    size = sum(f.stat().st_size for f in store.iterdir())
    print(
        f"data: {spec.describe()}: {len(corpus.doc_lengths):,} documents, {len(corpus.tokens):,} tokens "
        f"({corpus.tokens.dtype}) in {store} ({size / 2**20:,.1f} MiB)"
    )
    return store


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="validate")
def main(cfg: DictConfig) -> None:
    try:
        fetch(cfg)
    except Exception as err:
        line, code = exit_for(err)
        print(line, file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    entry(main)
