"""Where the gateway takes a conversation's id from (``with_session``): the body's session_id, the
X-Session-ID header, the OpenAI ``user`` field with --session-from-user; bad ids are 400s naming them."""

from __future__ import annotations

import pytest

from schemas.generate import GenerateRequest
from services.gateway.config import GatewayConfig
from services.gateway.openai_mapping import BadParam, with_session


def test_body_then_header_then_user():
    plain = GenerateRequest(prompt="hi")
    assert with_session(plain, None, None).session_id is None
    assert with_session(plain, "conv-1", "alice").session_id == "conv-1"
    assert with_session(plain, None, "alice").session_id == "alice"
    assert with_session(plain, None, "  ").session_id is None  # an empty user names nobody
    named = GenerateRequest(prompt="hi", session_id="body")
    assert with_session(named, "conv-1", "alice").session_id == "body"


@pytest.mark.parametrize("header,user,param", [(" ", None, "X-Session-ID"), ("x" * 257, None, "X-Session-ID"),
                                               (None, "u" * 257, "user")])
def test_a_blank_or_too_long_id_is_refused_by_name(header, user, param):
    with pytest.raises(BadParam, match=param) as caught:
        with_session(GenerateRequest(prompt="hi"), header, user)
    assert caught.value.param == param


def test_session_from_user_is_off_by_default():
    assert GatewayConfig().session_from_user is False
