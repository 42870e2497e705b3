"""`python -m voltllm.bench serve ...` / `python -m voltllm.bench plot RESULT.json`."""

from __future__ import annotations

import sys

from voltllm.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
