"""``python -m slime_rc`` is the ``slime-rc`` command."""
import sys

from slime_rc.cli import main

sys.exit(main())
