"""The documented exceptions: DDP tests torch's DDP passes that ringtrain's need not pass."""

EXPECTED_FAILURES: dict[str, str] = {}
