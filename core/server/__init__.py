"""The OpenAI-compatible HTTP server: wire protocol, errors and response builders.

``protocol`` decodes and validates request bodies and maps them to ``SamplingParams``;
``responses`` builds the response and streaming-chunk bodies; ``errors`` holds the API errors
with their HTTP status and OpenAI error body. None of these modules does any HTTP itself.
"""
