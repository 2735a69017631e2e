"""Data: real documents, tokenisation, packing into global batches, dataset length lists, and the
planning loader (plans made ahead in worker processes, shared through the Store)."""

from .corpus import byte_tokenize, load_documents, pack_batches, packed_document_lengths, stdlib_text_files
from .lengths import dataset_lengths, load_lengths, long_data_collections_lengths, longalign_lengths, save_lengths
from .plan_store import PlanningError, PlanningTimeoutError
from .planning import PlannedBatch, PlanningConfig, PlanningLoader, PlanningPool, plan_batch, planning_pool
from .synthetic import long_tail_lengths

__all__ = ["byte_tokenize", "load_documents", "pack_batches", "packed_document_lengths", "stdlib_text_files", "long_tail_lengths",
           "dataset_lengths", "longalign_lengths", "long_data_collections_lengths", "save_lengths", "load_lengths",
           "PlanningLoader", "PlanningConfig", "PlannedBatch", "PlanningError", "PlanningTimeoutError", "plan_batch",
           "PlanningPool", "planning_pool"]
