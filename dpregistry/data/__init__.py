"""Data loading helpers for objectives: text data sets through Hugging Face ``datasets`` (and their
recipe schema) and scikit-learn's bundled data sets."""

from .tabular import load_tabular
from .text import Encoded, TextData, TextTable, k_shot, make_table, read_file, user_ids

__all__ = ["Encoded", "TextData", "TextTable", "k_shot", "load_tabular", "make_table", "read_file", "user_ids"]
