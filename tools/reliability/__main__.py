"""`python -m tools.reliability [options]`: fuzzing, disconnect storms, overload, faults, shutdown and soak against
pagedllm servers (``cli.main``)."""

import argparse
import logging
import sys

from tools.reliability.cli import add_args, main

parser = argparse.ArgumentParser(prog="python -m tools.reliability", description="fuzzing, disconnect storms, "
                                 "overload, faults, shutdown, soak: figures")
add_args(parser)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(main(parser.parse_args()))
