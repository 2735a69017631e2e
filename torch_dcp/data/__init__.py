"""Data: real documents, tokenisation and packing into global batches."""

from .corpus import byte_tokenize, load_documents, pack_batches, stdlib_text_files

__all__ = ["byte_tokenize", "load_documents", "pack_batches", "stdlib_text_files"]
