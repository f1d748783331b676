"""pos: transparent, concurrent checkpoint/restore of Linux processes that use GPUs."""

__version__ = "0.1.0"
