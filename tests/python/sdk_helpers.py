"""Helpers shared by the SDK test files: reading what the SDKs stream, timing their retries."""
import time



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


class Timeline:
    """httpx event hooks that note when each request leaves and each response head arrives."""

    def __init__(self):
        self.events = []

    def request(self, request):
        self.events.append(("request", time.perf_counter(), None))

    def response(self, response):
        self.events.append(("response", time.perf_counter(), response.headers))

    async def arequest(self, request):
        self.request(request)

    async def aresponse(self, response):
        self.response(response)

    def hooks(self, asynchronous=False):
        if asynchronous:
            return {"request": [self.arequest], "response": [self.aresponse]}
        return {"request": [self.request], "response": [self.response]}

    def waited_and_told(self):
        """The SDK's wait between its first response and its retry, and the wait keel asked
        for in that response (both in seconds)."""
        kinds = [e[0] for e in self.events]
        assert kinds == ["request", "response", "request", "response"], kinds
        headers = self.events[1][2]
        return self.events[2][1] - self.events[1][1], int(headers["retry-after-ms"]) / 1000
