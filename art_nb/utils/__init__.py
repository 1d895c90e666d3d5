"""`art_nb.utils`, where ART keeps its helpers: `from art.utils import iterate_dataset` ports unchanged."""

from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .retry import retry
from .strip_logprobs import strip_logprobs

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry", "strip_logprobs"]
