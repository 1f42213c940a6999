"""``python -m phx`` is the ``phx`` command."""
import sys

from phx.cli import main

sys.exit(main())
