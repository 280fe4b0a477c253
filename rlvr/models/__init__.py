"""Policies: the built-in tiny transformer (and, later, Hugging Face models)."""
