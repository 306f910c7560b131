"""pitstop's imperative shell: torch state, files, the background writer, signals.

It asks :mod:`pitstop.core` what to do and does exactly that.
"""
