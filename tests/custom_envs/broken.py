"""A package module that fails on import (tests/test_custom_envs.py: the error names it)."""

raise ImportError("this module is broken on purpose")
