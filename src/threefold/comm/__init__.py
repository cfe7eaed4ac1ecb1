"""All communication of threefold: counted, recorded collectives and their differentiable forms."""

from .autograd import (all_gather_from_group, copy_to_group, gather_from_group, reduce_from_group,
                       reduce_scatter_to_group, scatter_to_group)
from .collectives import AllOf, CollectiveRecord, Comm, Handle, Traffic, ring_chunk

__all__ = ["Comm", "Handle", "AllOf", "Traffic", "CollectiveRecord", "ring_chunk", "copy_to_group",
           "reduce_from_group", "gather_from_group", "scatter_to_group", "reduce_scatter_to_group", "all_gather_from_group"]
