"""Attention providers: the torch reference, Triton kernels, FlashInfer."""

from sparseengine.attention.provider import AttentionProvider, make_provider

__all__ = ["AttentionProvider", "make_provider"]
