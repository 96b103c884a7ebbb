"""`engine.rerun`: the one path that runs a call again after it failed."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from jmp_policy.engine.rerun import run_again_where_refused

PACKAGE = Path(__file__).resolve().parent.parent / "jmp_policy"


class Refused(Exception):
    pass


def _refuse() -> str:
    raise Refused("as the policy has it")


def test_a_refused_call_runs_again_once_and_says_so():
    runs = []

    def again(error):
        runs.append(error)
        return "second form"

    with pytest.warns(RuntimeWarning, match="second form after: as the policy has it") as said:
        out = run_again_where_refused(
            _refuse,
            again,
            refused=lambda e: isinstance(e, Refused),
            says=lambda e: f"second form after: {e}",
        )
    assert out == "second form"
    assert len(runs) == 1 and isinstance(runs[0], Refused)
    assert len(said) == 1


def test_any_other_error_and_a_first_success_are_left_alone():
    def again(error):
        raise AssertionError("not to be run")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_again_where_refused(lambda: 1, again, refused=bool, says=str) == 1
        with pytest.raises(KeyError, match="the user's own"):
            run_again_where_refused(
                lambda: {}["the user's own"], again, refused=lambda e: False, says=str
            )


@pytest.mark.parametrize("note", [None, "Run again, it failed too."])
def test_where_the_second_form_fails_too_the_first_error_is_raised(note):
    def again(error):
        raise ValueError("the second form's own")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Refused) as info:
            run_again_where_refused(_refuse, again, refused=bool, says=str, note=note)
    assert str(info.value) == "as the policy has it"
    assert getattr(info.value, "__notes__", None) == (None if note is None else [note])


def test_no_module_but_rerun_warns_of_a_second_run():
    # Every run again goes through `run_again_where_refused`: no other module
    # of the package warns a `RuntimeWarning` of its own.
    warning = re.compile(r"warnings\.warn\([^)]*RuntimeWarning", re.S)
    found = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "rerun.py" and warning.search(p.read_text())
    ]
    assert found == [], found
