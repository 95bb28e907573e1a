"""Compression during training: pruning schedules, QAT fake quantization (int8 to binary) and k-means weight sharing,
as callbacks that work on whole, ZeRO- and TP-sharded weights through the strategy's `owned_weights()` service; and
post-training quantization (`PTQ`, no Lightning) of a trained model."""

from lit_lm.callbacks.compress.kmeans import KMeansQuantization
from lit_lm.callbacks.compress.ptq import PTQ
from lit_lm.callbacks.compress.pruning import Pruning, SparsitySchedule
from lit_lm.callbacks.compress.qat import QAT, IntLinear

__all__ = ["IntLinear", "KMeansQuantization", "PTQ", "Pruning", "QAT", "SparsitySchedule"]
