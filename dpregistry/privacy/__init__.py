"""Privacy events, conversions, the ledger and the accountant contract."""
