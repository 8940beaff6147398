"""The append-only, hash-chained ledger of test-split openings, and the grants it issues.

``Ledger(RESULTS/ledger.jsonl)`` records each ``confirm`` before the test split is touched;
``require_grant`` is the check the data layer runs before materializing a test window.
"""

from healsweep.ledger._chain import canonical_json, entry_hash
from healsweep.ledger._grant import CONFIRM_HINT, Grant
from healsweep.ledger._heads import check_extends, head_record, names
from healsweep.ledger._ledger import (
    LEDGER_NAME,
    Ledger,
    Milestone,
    require_grant,
    require_split_unchanged,
    split_drift,
)

__all__ = [
    "CONFIRM_HINT",
    "LEDGER_NAME",
    "Grant",
    "Ledger",
    "Milestone",
    "canonical_json",
    "check_extends",
    "entry_hash",
    "head_record",
    "names",
    "require_grant",
    "require_split_unchanged",
    "split_drift",
]
