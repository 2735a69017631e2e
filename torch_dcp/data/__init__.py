"""Data: real documents, tokenisation and packing into global batches."""

from .corpus import byte_tokenize, load_documents, pack_batches, stdlib_text_files
from .synthetic import long_tail_lengths

__all__ = ["byte_tokenize", "load_documents", "pack_batches", "stdlib_text_files", "long_tail_lengths"]
