"""The version of perseus_legacy: its one place (setup.py reads it from here)."""

__version__ = "0.1.0"
