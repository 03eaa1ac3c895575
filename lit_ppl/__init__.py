"""lit-ppl: exact perplexity of causal language models, from one CPU process to many GPU nodes."""

import logging as _logging

# torchao's cp310 extensions cannot load on other Pythons and say so at import, as does its enum
# registration with torch.compile; neither affects the pure-PyTorch paths lit-ppl uses. Real errors still show.
for _name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
