"""Model architectures (one file per family) and the registry that maps HF architecture
names to them."""
