"""Optimizers by name (registry.py): AdamW, SGD, Muon, 1-bit Adam's entry; each one file with its
`OptimizerEntry` (entry.py). exchange.py assembles whole matrices for the optimizers that need them."""
