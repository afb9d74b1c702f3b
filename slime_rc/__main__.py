"""``python -m slime_rc`` is the ``slime-rc`` command."""
import sys

from .cli import main

sys.exit(main())
