"""Lower KV tiers: the Tier protocol, host / disk tiers, and the TierManager's policy."""

from .disk import DiskTier
from .host import HostEntry, HostTier
from .manager import TierManager
from .protocol import COUNTERS, Parts, Tier, leading
from .record import FORMAT_VERSION, Record, RecordMismatch, parse_record, verify_record

__all__ = ["COUNTERS", "DiskTier", "FORMAT_VERSION", "HostEntry", "HostTier", "Parts", "Record",
           "RecordMismatch", "Tier", "TierManager", "leading", "parse_record", "verify_record"]
