"""One-off measurement and set-up scripts (A/B of kernel versions, emulated ARM tests, candidate sets); the
A/B scripts that import ``tools.scripts.kernel_build`` run as ``python3 -m tools.scripts.NAME`` from the checkout."""
