"""Stand-in: slime/utils/__init__.py of THUDM/slime@624b824 (a docstring only)."""
