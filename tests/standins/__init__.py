"""Tiny stand-ins for other projects' diffusion LMs: the same module layout, parameter names and forward
signatures, written from the architecture description and checked against golden outputs of the public
implementations (tests/fixtures/<name>/README.md names them)."""
