"""Serving over HTTP: the OpenAI-compatible server, the web demo, and what one request may ask.
"""
