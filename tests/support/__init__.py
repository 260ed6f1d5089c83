"""What the tests share, one copy each: paths and the speech set, bundled and random models, engines
run to completion, transformers as the reference, a free port. Fixtures live in tests/conftest.py."""
