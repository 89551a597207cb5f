"""Accountant plugins: RDP, PLD and zCDP accountants and privacy filters (dp-accounting)."""

from dpregistry import hookimpl

from .accountants import ACCOUNTANTS


@hookimpl
def dpreg_register_accountants(register):
    for cls in ACCOUNTANTS:
        register(cls)
