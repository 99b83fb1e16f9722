"""Lower KV tiers: the Tier protocol, host page slots, a disk tier (segment files + an LMDB
index), and the TierManager's policy over them (remote and peer paths: ``tiers.remote``,
``tiers.peer``)."""

from .disk import DiskTier
from .diskschema import TierDamaged
from .host import HostEntry, HostTier
from .manager import TierManager
from .protocol import COUNTERS, Parts, Tier, leading
from .record import FORMAT_VERSION, Record, RecordMismatch, parse_record, verify_record

__all__ = ["COUNTERS", "DiskTier", "FORMAT_VERSION", "HostEntry", "HostTier", "Parts", "Record",
           "RecordMismatch", "Tier", "TierDamaged", "TierManager", "leading", "parse_record",
           "verify_record"]
