"""`art_nb.utils`, where ART keeps its helpers: `from art.utils import iterate_dataset` ports unchanged.
`carry_context` is art_nb's own (a hand-started thread's calls recorded in the rollout's trajectory)."""

from .carry_context import carry_context
from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .retry import retry
from .strip_logprobs import strip_logprobs

__all__ = ["DatasetBatch", "carry_context", "iterate_dataset", "limit_concurrency", "retry", "strip_logprobs"]
