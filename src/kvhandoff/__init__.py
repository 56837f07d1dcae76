"""kvhandoff: declared state machines for moving caches between inference instances."""

__version__ = "0.1.0"
