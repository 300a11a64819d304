"""`python -m pagedllm.bench.ladder --phase hf-ids ...`: a step-1 phase in its own process (``run._phase_main``)."""

import sys

from pagedllm.bench.ladder.run import _phase_main

sys.exit(_phase_main())
