"""The rank contract's file names: built and read back by the one module that knows them."""

from __future__ import annotations

import pytest

from eyas.state import contract


def test_file_names_are_built_and_read_back():
    assert contract.rank_file(3, contract.ERROR) == "rank-3.error.json"
    assert contract.tp_file(1, contract.LOG) == "tp-1.log"
    assert contract.rank_of_log(contract.rank_file(12, contract.LOG)) == 12
    assert contract.tp_rank_of(contract.tp_file(7, contract.PROC)) == 7
    # Other files of the attempt are not logs or registrations.
    assert contract.rank_of_log("rank-3.log.1") is None
    assert contract.rank_of_log(contract.rank_file(3, contract.PROGRESS)) is None
    assert contract.tp_rank_of(contract.tp_file(7, contract.LOG)) is None
    assert contract.rank_of_log("driver.log") is None


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'logs' is not a rank file"):
        contract.rank_file(0, "logs")
    with pytest.raises(ValueError, match="'done.json' is not a TP worker file"):
        contract.tp_file(0, contract.DONE)
