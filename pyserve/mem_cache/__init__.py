"""KV memory: the Python facade over the Rust core's cache and allocators, and the KV tensors."""
