"""Decode options checked once: the ingress asks a decoder replica whether the model can decode a
request's options before any of its windows is encoded (a bad request costs no encoder work), and
remembers the option sets it accepted. Acceptance depends on the model alone, which every decoder
replica serves, so an answer holds; the next request with the same options skips the round trip
to a replica whose event loop shares its process with a busy decode loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

from engine.errors import RequestRejectedError
from engine.types import DecodeOptions

# Distinct option sets remembered (the least recently used are forgotten): requests with prompts
# of their own each make one.
REMEMBERED = 512


class AcceptedOptions:
    def __init__(
        self,
        ask: Callable[[DecodeOptions], Awaitable[RequestRejectedError | None]],
        capacity: int = REMEMBERED,
    ):
        """``ask``: the decoder's check_options, which returns the rejection of options it cannot
        decode with (None: accepted)."""
        self.ask = ask
        self.capacity = capacity
        self._accepted: OrderedDict[DecodeOptions, None] = OrderedDict()

    async def check(self, options: DecodeOptions) -> None:
        if options in self._accepted:
            self._accepted.move_to_end(options)
            return
        rejection = await self.ask(options)
        if rejection is not None:  # raised here, and not remembered
            raise rejection
        self._accepted[options] = None
        if len(self._accepted) > self.capacity:
            self._accepted.popitem(last=False)
