"""The showcase: a tiny GPT trained under `flashrecovery run`, a rank killed, a lossless recovery.

`flashrecovery demo` is in ``cli``; ``train`` is the script each rank runs; ``model`` and ``data``
are deterministic so runs can be compared bitwise.
"""
