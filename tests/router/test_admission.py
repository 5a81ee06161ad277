"""``router.admission``: the FIFO turn hands over to a request that is cancelled in the
same moment without that request keeping it (on Python 3.11 ``asyncio.wait_for`` could
return the lock acquired and swallow the cancel: the client had left, and its request
went on to the workers holding the router's turn)."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.admission import Admission


def test_a_request_cancelled_as_the_turn_reaches_it_does_not_keep_the_turn() -> None:
    async def scenario() -> None:
        admission = Admission(8, None)
        deadline = time.monotonic() + 30.0
        await admission.wait_turn(deadline)  # the head holds the turn
        waiter = asyncio.get_running_loop().create_task(admission.wait_turn(deadline))
        await asyncio.sleep(0.01)  # it waits for the turn
        admission.pass_turn()
        waiter.cancel()  # its client left in the same moment
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # the turn is free: the next request takes it at once
        await asyncio.wait_for(admission.wait_turn(deadline), 1.0)

    asyncio.run(scenario())


def test_an_upper_bound_of_the_prompt_is_refused_only_when_no_token_fits() -> None:
    # the cheap check before tokenizing has only an upper bound (a text's bytes, about
    # 4 times its tokens): it must not refuse a prompt that would fit once counted
    from router.errors import RouteError

    admission = Admission(8, 100)
    admission.enter("queued", 90)
    admission.check(50, upper_bound=True)  # 50 bytes may be 10 tokens: tokenize first
    with pytest.raises(RouteError, match="max-queued-tokens"):
        admission.check(50)  # 50 tokens do not fit
    admission.enter("more", 10)
    with pytest.raises(RouteError, match="max-queued-tokens"):
        admission.check(50, upper_bound=True)  # no room at all
