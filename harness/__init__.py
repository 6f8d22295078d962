"""The checkout-only scenario harness: `make demo`, the benches and the e2e tests drive the operator
and the reference servers on a devcluster through it.

It is not shipped: neither the wheel nor the image contains it (nor `devcluster`). A checkout's
virtual environment finds both through the `.pth` file the Makefile's `venv` target writes.
"""
