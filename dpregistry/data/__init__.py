"""Data loading helpers for objectives: text tables and scikit-learn's bundled data sets."""

from .tabular import load_tabular
from .text import TextTable, k_shot, load_table

__all__ = ["TextTable", "k_shot", "load_table", "load_tabular"]
