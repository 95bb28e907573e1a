"""Compression during training: pruning schedules, QAT fake quantization and k-means weight sharing, as
callbacks that work on whole, ZeRO- and TP-sharded weights through the strategy's `owned_weights()` service."""

from callbacks.compress.kmeans import KMeansQuantization
from callbacks.compress.pruning import Pruning, SparsitySchedule
from callbacks.compress.qat import QAT, IntLinear

__all__ = ["IntLinear", "KMeansQuantization", "Pruning", "QAT", "SparsitySchedule"]
