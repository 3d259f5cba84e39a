"""Attention over the paged KV pool and the decode mirrors: the building blocks the model's
forward pass uses, below both the model and the engine."""
