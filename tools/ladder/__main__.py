"""`python -m tools.ladder [options]`: the optimization ladder (``run.main``); with ``--phase hf-ids ...``, a step-1
phase in its own process (``run._phase_main``, which the ladder starts)."""

import logging
import sys

from tools.ladder.run import _phase_main, build_parser

if "--phase" in sys.argv[1:]:
    sys.exit(_phase_main())
args = build_parser().parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(args.func(args))
