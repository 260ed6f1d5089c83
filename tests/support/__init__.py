"""What the tests share, one copy each: paths and the speech set, bundled and random models, engines
run to completion, transformers as the reference, a free port, the running app's metrics, a load
generator, the autoscaling scenario and a live realtime caller. Fixtures live in tests/conftest.py.
The benchmarks import from here too; nothing here imports from benchmarks/."""
