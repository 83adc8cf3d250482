"""Tests of torch's generic backend suite that pass on gloo but not on cocosync, each with why (empty: none known
in the selection `make test-torch-suite` runs)."""

EXCEPTIONS: dict[str, str] = {}
