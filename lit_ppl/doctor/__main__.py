"""``python -m lit_ppl.doctor``: runs :func:`lit_ppl.doctor.cli.main` and exits with its status."""

import sys

from lit_ppl.doctor.cli import main

sys.exit(main())
