"""Backends: where a model is served and trained. Import the one you use; each loads lazily."""
