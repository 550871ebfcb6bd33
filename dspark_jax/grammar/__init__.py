"""Structured output: a request's regex, JSON schema or JSON object as a token DFA walked on the device.

compile.py turns the request's grammar into a dense table next[state, token] (outlines-core
builds the automaton); dfa.py masks logits and walks the table inside the compiled steps;
pool.py keeps the tables of admitted requests' grammars on the device and each slot's state.
"""
