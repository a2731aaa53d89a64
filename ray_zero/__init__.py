"""ray_zero: measure what DeepSpeed ZeRO buys in memory and costs in speed, with a Ray Tune grid."""

__version__ = "0.1.0"
