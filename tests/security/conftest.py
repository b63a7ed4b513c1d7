"""tests/security: the attack suite (each audit finding of issue 12 against the real component on loopback)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
