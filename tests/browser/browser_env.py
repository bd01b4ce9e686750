"""Where the browser tests find Chromium and how they start it (a module of its own: two
``conftest`` modules cannot be told apart by import)."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
# Chromium must neither phone home nor need a display or a sandbox-capable kernel (CI runs as root
# in a container).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS = 15_000
