"""``python -m lit_ppl.report RUN_DIR ...``: compare finished runs (:mod:`lit_ppl.report.runs`)."""

import sys

from lit_ppl.report.runs import main

sys.exit(main())
