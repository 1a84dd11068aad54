"""Admission (server/generation.py): places counted in sequences (prompts x n), per request and
per client (the request's `user`), all given back."""

from __future__ import annotations

import pytest

from forkpoint.server.errors import APIError
from forkpoint.server.generation import Admission


def test_n_takes_n_places_and_gives_them_back():
    admission = Admission(4, 1)
    admission.admit(1, n=3)
    with pytest.raises(APIError) as info:  # 3 + 2 > 4: full for now
        admission.admit(1, n=2)
    assert info.value.status == 503
    with pytest.raises(APIError) as info:  # 5 > 4: never fits
        admission.admit(1, n=5)
    assert info.value.status == 400 and info.value.param == "n"
    admission.first_token(3)
    assert (admission.waiting, admission.running) == (0, 3)
    admission.release("running", 3)
    assert (admission.waiting, admission.running, admission.waiting_by_client) == (0, 0, {})


def test_one_client_cannot_fill_the_queue_for_everyone():
    admission = Admission(10, 1, max_waiting_per_client=3)
    admission.admit(2, client="greedy")
    with pytest.raises(APIError) as info:
        admission.admit(1, n=2, client="greedy")
    assert info.value.status == 503 and "per client" in info.value.message
    admission.admit(3, client="polite")  # others are still admitted
    admission.admit(1, client="")  # requests without a user are one client
    admission.release("waiting", client="greedy")
    admission.admit(1, n=2, client="greedy")  # a place came back
    assert admission.waiting_by_client == {"greedy": 3, "polite": 3, "": 1} and admission.waiting == 7
    with pytest.raises(APIError) as info:  # more than one client may ever hold: never fits
        admission.admit(1, n=4, client="new")
    assert info.value.status == 400 and info.value.param == "n"
