"""infertrace serve's models read text only: a chat request carrying an image gets a 400 that says so, never an
answer that ignored the image."""

from __future__ import annotations

import pytest

from infertrace.server.frontend.protocol import ApiError, Endpoint, parse_generate_request

TEXT = {"type": "text", "text": "what is in it?"}


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_image", "image_url": "https://example.com/a.png"},
    {"type": "image_embeds", "image_embeds": "AAAA"},
])
def test_an_image_part_is_refused_with_a_400_that_says_so(part):
    with pytest.raises(ApiError) as err:
        parse_generate_request({"messages": [{"role": "user", "content": [part, TEXT]}]}, Endpoint.CHAT)
    assert err.value.status == 400 and err.value.param == "messages"
    assert err.value.message.startswith("images are not supported by the bundled engine: messages[0].content has "
                                        f"an {part['type']} part")


def test_text_parts_still_pass():
    req = parse_generate_request({"messages": [{"role": "user", "content": [TEXT, TEXT]}]}, Endpoint.CHAT)
    assert req.messages == [{"role": "user", "content": "what is in it?what is in it?"}]
