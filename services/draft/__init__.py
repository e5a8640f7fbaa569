"""Speculative decoding's drafters (``ngram``, ``model``) behind one protocol (services.draft.base)."""
