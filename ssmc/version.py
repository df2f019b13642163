"""The version of ssmc (a leaf module: generated sources carry it, and importing it loads nothing else)."""

__version__ = "0.1.0"
