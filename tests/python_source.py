"""The project's source read as trees, for the tests that check its structure without importing
it (``test_imports``, ``test_layout_owner``)."""

import ast
import gc


def parse(source: str, filename: str = "<source>") -> ast.Module:
    """``ast.parse`` that no other thread's parse runs inside. CPython 3.11 counts the AST
    builder's recursion once per interpreter, not per thread: when a garbage collection in the
    middle of this parse runs a finalizer, another thread can take the interpreter and parse too
    (the traceback module parses every line it underlines, as a background thread's log record
    with its exception is formatted), and this parse then fails with ``SystemError: AST
    constructor recursion depth mismatch`` (seen in CI, beside Ray Data's usage thread). With the
    collector off, the parse runs no Python code, so no other thread runs during it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename)
    finally:
        if collecting:
            gc.enable()
