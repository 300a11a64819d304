"""Development tools, kept out of the installed package: the optimization ladder (``python -m tools.ladder``), the
reliability harness (``python -m tools.reliability``) and the one-off A/B and set-up scripts (``tools/scripts/``).
Run them from a checkout's root; they drive pagedllm through its public commands and modules."""
