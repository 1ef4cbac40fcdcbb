"""Test helpers: deterministic tiny Hugging Face checkpoints built offline.

Nothing here is imported by the runtime package; it needs ``transformers`` and
``tokenizers`` (the ``test`` extra). ``build_tiny_model`` is imported lazily so
that ``python -m zipserv_vllm.testing.tiny_model`` runs the module only once.
"""

__all__ = ["build_tiny_model"]


def __getattr__(name):
    if name == "build_tiny_model":
        from .tiny_model import build_tiny_model

        return build_tiny_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
