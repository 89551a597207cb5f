"""Data loading helpers for objectives: text tables (and their recipe schema) and scikit-learn's bundled data sets."""

from .tabular import load_tabular
from .text import TextData, TextTable, k_shot, load_table

__all__ = ["TextData", "TextTable", "k_shot", "load_table", "load_tabular"]
