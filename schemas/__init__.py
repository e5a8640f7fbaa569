"""Wire messages of kvbus, one module per boundary they cross.

Every message is a frozen, keyword-only msgspec Struct named ``*Request``,
``*Reply``, ``*Event`` or ``*Chunk``. New fields go last and carry defaults so
older peers keep decoding; ``tests/unit/test_wire_golden.py`` guards the bytes.
"""
