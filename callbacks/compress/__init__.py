"""Compression during training: pruning schedules, QAT fake quantization (int8 to binary) and k-means weight sharing,
as callbacks that work on whole, ZeRO- and TP-sharded weights through the strategy's `owned_weights()` service; and
post-training quantization (`PTQ`, no Lightning) of a trained model."""

from callbacks.compress.kmeans import KMeansQuantization
from callbacks.compress.ptq import PTQ
from callbacks.compress.pruning import Pruning, SparsitySchedule
from callbacks.compress.qat import QAT, IntLinear

__all__ = ["IntLinear", "KMeansQuantization", "PTQ", "Pruning", "QAT", "SparsitySchedule"]
