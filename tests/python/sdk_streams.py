"""Readers for what the SDKs stream, shared by the SDK test files."""


def read_openai_stream(stream):
    """The text, finish reason and usage chunk of a streamed chat completion."""
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage
