"""Hypothesis keeps caches in `.hypothesis/` under the working directory; keep them out of the
repository (and the example database off: the property tests are derandomized)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis.configuration import set_hypothesis_home_dir

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llmplatform-hypothesis")
