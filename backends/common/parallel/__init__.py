"""Parallelism every engine shares, applied from outside the models (the mesh first)."""
