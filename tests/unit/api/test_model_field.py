"""The OpenAI `model` field with several models (docs/API.md "Several models"): what a request
asks for and what its answer names."""

from __future__ import annotations

import pytest

from agent.api.http.convert import answer_model, model_of
from agent.api.http.errors import HttpError


def test_model_and_keep_alive_of_a_body() -> None:
    assert model_of({}) == ("", None)
    assert model_of({"model": "code", "keep_alive": "5m"}) == ("code", 300.0)
    assert model_of({"model": "", "keep_alive": 0}) == ("", 0.0)
    assert model_of({"keep_alive": -1})[1] == float("inf")
    with pytest.raises(HttpError, match="model must be a string") as e:
        model_of({"model": 3})
    assert e.value.param == "model"
    with pytest.raises(HttpError, match="keep_alive") as e:
        model_of({"keep_alive": "soon"})
    assert e.value.param == "keep_alive" and e.value.status == 400


def test_the_answer_names_the_model_that_answered() -> None:
    # one model, no [models]: its metadata name whatever was asked, as before
    assert answer_model({"model": "gpt-4o"}, ["tiny-test"], "tiny-test") == "tiny-test"
    # one named model: any name reaches it, the answer says its name
    assert answer_model({"model": "gpt-4o"}, ["chat"], None) == "chat"
    # several: the name asked for; none: the default (first)
    assert answer_model({"model": "code"}, ["chat", "code"], None) == "code"
    assert answer_model({}, ["chat", "code"], None) == "chat"
