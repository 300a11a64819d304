"""`python -m pagedllm.entrypoints.openai.api_server` — the OpenAI-compatible server with vLLM's flag names."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from pagedllm.quant.verdicts import start_sha256_for_command

    start_sha256_for_command(sys.argv[1:] if argv is None else list(argv))  # before the imports below (torch)
    from pagedllm.engine.arg_utils import add_engine_args
    from pagedllm.server.cli_args import add_server_args, run_server

    p = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server")
    add_server_args(p)
    add_engine_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_server(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
