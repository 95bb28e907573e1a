"""Suite-wide settings. TRITON_INTERPRET must be set before anything imports triton (`import lightning` does), so
that the kernel tests run Triton's interpreter on CPU instead of skipping."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
