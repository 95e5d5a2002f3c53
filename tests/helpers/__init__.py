"""What tests in several files share, as plain modules (``from helpers.gguf import tiny_gguf``):
a test module never imports another test module (tests/api/test_layout.py checks it). pytest puts
tests/ on sys.path (pyproject's ``pythonpath``); fixtures stay in tests/conftest.py."""
