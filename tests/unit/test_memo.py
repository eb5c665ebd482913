"""The router's memo of what it built and checked for a request's tools and grammar."""

import pytest

from app.conversations.memo import Memo


def test_the_least_recently_used_result_leaves_first_and_a_failure_is_not_remembered():
    memo: Memo[int] = Memo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # used: "b" is now the oldest
    memo.put("c", 3)
    assert (memo.get("a"), memo.get("b"), memo.get("c")) == (1, None, 3)
    with pytest.raises(ValueError):
        memo.get_or_make("d", lambda: (_ for _ in ()).throw(ValueError("refused")))
    assert memo.get("d") is None and memo.get_or_make("d", lambda: 4) == 4 and memo.get("d") == 4
