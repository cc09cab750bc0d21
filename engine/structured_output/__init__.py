"""Structured output: constrain what a request may generate to a grammar (vLLM's v1/structured_output).

request.py holds a request's grammar (no xgrammar import: the text services read engine.request);
manager.py compiles grammars with xgrammar and builds each step's token bitmask.
"""
