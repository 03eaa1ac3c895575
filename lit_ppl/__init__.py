"""lit-ppl: exact perplexity of causal language models, from one CPU process to many GPU nodes."""
