"""Model building blocks: norms, rotary embedding, activations, attention backends, logits
processing and sampling. Math lives in `pyserve_kernels`; these modules hold parameters and
batch plumbing."""
