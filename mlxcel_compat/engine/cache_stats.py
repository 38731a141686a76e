"""The bodies of the prompt cache's admin endpoints that are more than a store's own counters: the
``tiers`` part of ``GET /v1/cache/stats`` and the reply of ``POST /v1/cache/reset``."""

from __future__ import annotations

from typing import Any

RESET_TIERS = ("ram", "disk", "all")


def tiers_stats(out: dict[str, Any], disk: dict[str, Any]) -> dict[str, Any]:
    """``tiers.ram`` (both RAM stores) and ``tiers.disk`` of ``GET /v1/cache/stats``."""
    ram_hits = out["hits"] + out["snapshot_hits"] - disk["hits"]
    return {
        "ram": {
            "entries": out["entries"] + out["snapshot_entries"],
            "bytes": out["bytes"] + out["snapshot_bytes"],
            "capacity_bytes": out["capacity_bytes"] + out["snapshot_capacity_bytes"],
            "hits": max(ram_hits, 0),
        },
        "disk": disk,
    }


def reset_result(tier: str, ram: tuple[int, int], disk: tuple[int, int]) -> dict[str, Any]:
    """The body of ``POST /v1/cache/reset``: totals plus what each tier dropped."""
    return {
        "success": True,
        "tier": tier,
        "cleared_entries": ram[0] + disk[0],
        "cleared_bytes": ram[1] + disk[1],
        "tiers": {
            "ram": {"cleared_entries": ram[0], "cleared_bytes": ram[1]},
            "disk": {"cleared_entries": disk[0], "cleared_bytes": disk[1]},
        },
    }
