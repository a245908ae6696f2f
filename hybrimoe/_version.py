"""hybrimoe's version, in one place (the package root and the server read it; pyproject.toml states it for the
build)."""
__version__ = "0.1.0"
