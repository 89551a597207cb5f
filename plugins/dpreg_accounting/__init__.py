"""Accountant plugins: RDP, PLD and zCDP accountants and privacy filters (dp-accounting)."""

from dpregistry import StagePlugin

# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "accountant": {
        "pld": "dpreg_accounting.accountants:PldAccountant",
        "rdp": "dpreg_accounting.accountants:RdpAccountant",
        "rdp_filter": "dpreg_accounting.accountants:RdpFilter",
        "zcdp": "dpreg_accounting.accountants:ZcdpAccountant",
    },
})
