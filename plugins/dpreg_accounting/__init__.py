"""Accountant plugins: RDP, PLD and zCDP accountants and privacy filters (dp-accounting)."""

from dpregistry import StagePlugin

from .accountants import ACCOUNTANTS

plugin = StagePlugin(*ACCOUNTANTS)
