"""Lower KV tiers: host page slots, a disk tier (segment files + an LMDB index), and the TierManager that moves pages."""

from .disk import DiskTier
from .diskschema import TierDamaged
from .host import HostEntry, HostTier
from .manager import TierManager
from .record import FORMAT_VERSION, Record, RecordMismatch, parse_record, verify_record

__all__ = ["DiskTier", "FORMAT_VERSION", "HostEntry", "HostTier", "Record", "RecordMismatch",
           "TierDamaged", "TierManager", "parse_record", "verify_record"]
