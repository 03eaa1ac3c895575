"""``python -m lit_ppl.report RUN_DIR ...``: compare finished runs (:mod:`lit_ppl.report.runs`);
``python -m lit_ppl.report frontier SWEEP_DIR``: a sweep's quantization frontier (:mod:`lit_ppl.report.frontier`)."""

import sys

if sys.argv[1:2] == ["frontier"]:
    from lit_ppl.report.frontier import main as frontier_main

    sys.exit(frontier_main(sys.argv[2:]))

from lit_ppl.report.runs import main

sys.exit(main())
